CREATE TABLE {outbox} (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    aggregate_type  TEXT NOT NULL,
    aggregate_id    BLOB NOT NULL,
    event_type      TEXT NOT NULL,
    payload         TEXT NOT NULL,
    occurred_at     INTEGER NOT NULL,
    published_at    INTEGER,
    retry_count     INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_retry_at   INTEGER,
    dead_at         INTEGER,
    claimed_until   INTEGER
);
CREATE INDEX {pending_idx} ON {outbox} (id)
    WHERE published_at IS NULL AND dead_at IS NULL;
CREATE INDEX {aggregate_idx} ON {outbox} (aggregate_id, id)
    WHERE published_at IS NULL;

CREATE TABLE {deliveries} (
    event_id        INTEGER NOT NULL REFERENCES {outbox} (id),
    subscriber      TEXT NOT NULL,
    aggregate_id    BLOB NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_retry_at   INTEGER NOT NULL,
    dead_at         INTEGER,
    claimed_until   INTEGER,
    PRIMARY KEY (subscriber, event_id)
);
CREATE INDEX {deliveries_head_idx} ON {deliveries} (subscriber, aggregate_id, event_id);
CREATE INDEX {deliveries_aggregate_idx} ON {deliveries} (aggregate_id);
CREATE INDEX {deliveries_due_idx} ON {deliveries} (next_retry_at) WHERE dead_at IS NULL;
