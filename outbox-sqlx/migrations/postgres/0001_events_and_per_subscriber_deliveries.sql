CREATE TABLE {outbox} (
    id              BIGSERIAL PRIMARY KEY,
    aggregate_type  TEXT NOT NULL,
    aggregate_id    UUID NOT NULL,
    event_type      TEXT NOT NULL,
    payload         JSONB NOT NULL,
    occurred_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
    published_at    TIMESTAMPTZ,
    retry_count     INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_retry_at   TIMESTAMPTZ,
    dead_at         TIMESTAMPTZ
);
COMMENT ON COLUMN {outbox}.published_at IS
    'set when every subscriber handled the event or holds it as a delivery of its own';
COMMENT ON COLUMN {outbox}.retry_count IS
    'times the event was parked (a newer payload version, an unknown event type)';
COMMENT ON COLUMN {outbox}.dead_at IS
    'set when the payload can never be decoded; an operator must requeue or fix it';

-- The relay's scan: pending events in id order. Dead events are not in it.
CREATE INDEX {pending_idx} ON {outbox} (id)
    WHERE published_at IS NULL AND dead_at IS NULL;
-- The few events that hold their aggregate back: dead or parked.
CREATE INDEX {stalled_idx} ON {outbox} (aggregate_id, id)
    WHERE published_at IS NULL AND (dead_at IS NOT NULL OR next_retry_at IS NOT NULL);

-- One row per batch a relay is working on: the events it claimed, until when. Claims are taken
-- one relay at a time (an advisory lock), so an event is never claimed twice at once, and no
-- event row is written to claim it.
CREATE TABLE {claims} (
    id        BIGSERIAL PRIMARY KEY,
    until     TIMESTAMPTZ NOT NULL,
    event_ids BIGINT[] NOT NULL
);

CREATE TABLE {deliveries} (
    event_id        BIGINT NOT NULL REFERENCES {outbox} (id),
    subscriber      TEXT NOT NULL,
    aggregate_id    UUID NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_retry_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    dead_at         TIMESTAMPTZ,
    claimed_until   TIMESTAMPTZ,
    PRIMARY KEY (subscriber, event_id)
);
COMMENT ON TABLE {deliveries} IS
    'one row per (subscriber, event) not yet delivered after the first pass; deleted once delivered';

-- Head of line: the earliest undelivered event of a (subscriber, aggregate).
CREATE INDEX {deliveries_head_idx} ON {deliveries} (subscriber, aggregate_id, event_id);
-- Which aggregates hold a subscriber back.
CREATE INDEX {deliveries_aggregate_idx} ON {deliveries} (aggregate_id);
-- Due retries.
CREATE INDEX {deliveries_due_idx} ON {deliveries} (next_retry_at)
    WHERE dead_at IS NULL;
