-- A claim's id is its token: renewals and outcomes name it and count only while it is live.
-- Claims keep the type of each aggregate beside its id: an aggregate is its type and id.
ALTER TABLE {claims} ADD COLUMN claimed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    ADD COLUMN aggregate_types TEXT[];
ALTER TABLE {claims} ALTER COLUMN aggregate_types SET STORAGE EXTERNAL;
UPDATE {claims} AS c
SET aggregate_ids = x.aggregate_ids, aggregate_types = x.aggregate_types
FROM (
    SELECT c.id, array_agg(o.aggregate_id ORDER BY e.n) AS aggregate_ids,
           array_agg(o.aggregate_type ORDER BY e.n) AS aggregate_types
    FROM {claims} AS c
    CROSS JOIN LATERAL unnest(c.event_ids) WITH ORDINALITY AS e(id, n)
    JOIN {outbox} AS o ON o.id = e.id
    GROUP BY c.id
) AS x
WHERE c.id = x.id;
UPDATE {claims} SET aggregate_ids = '{}', aggregate_types = '{}' WHERE aggregate_types IS NULL;

-- Events held back behind an earlier event of their aggregate are set aside, out of the relay's
-- scan: behind a claim that lasted (`held_by`, a claim id: released when that claim is over) or
-- behind a dead or parked event (`held_behind`, its id: released when it is published, skipped
-- or requeued). `holds` lists the claims some events are held by.
ALTER TABLE {outbox} ADD COLUMN held_by BIGINT,
    ADD COLUMN held_behind BIGINT,
    ADD COLUMN expired_claims INTEGER NOT NULL DEFAULT 0,
    ADD COLUMN payload_text TEXT;
COMMENT ON COLUMN {outbox}.expired_claims IS
    'claims of the event that expired before they were recorded: it may have been delivered before';
COMMENT ON COLUMN {outbox}.payload_text IS
    'the exact payload when JSONB cannot hold it (a \u0000 in a string); payload then has U+FFFD';
CREATE TABLE {holds} (claim_id BIGINT PRIMARY KEY);

-- The relay's scan: pending events that nothing holds, in id order. Parked events are found by
-- when they are due, dead ones never.
DROP INDEX {schema}.{pending_idx};
CREATE INDEX {pending_idx} ON {outbox} (id)
    WHERE published_at IS NULL AND dead_at IS NULL AND next_retry_at IS NULL
      AND held_by IS NULL AND held_behind IS NULL;
CREATE INDEX {parked_idx} ON {outbox} (next_retry_at)
    WHERE published_at IS NULL AND dead_at IS NULL AND next_retry_at IS NOT NULL;
-- Everything that holds an aggregate back or waits behind it: dead, parked, held.
DROP INDEX {schema}.{stalled_idx};
CREATE INDEX {stalled_idx} ON {outbox} (aggregate_id, id)
    WHERE published_at IS NULL AND (dead_at IS NOT NULL OR next_retry_at IS NOT NULL
      OR held_by IS NOT NULL OR held_behind IS NOT NULL);
CREATE INDEX {held_by_idx} ON {outbox} (held_by) WHERE held_by IS NOT NULL;
CREATE INDEX {held_behind_idx} ON {outbox} (held_behind) WHERE held_behind IS NOT NULL;

-- Deliveries: keyed by the aggregate's type too, claimed under a claim's token.
ALTER TABLE {deliveries} ADD COLUMN aggregate_type TEXT,
    ADD COLUMN claim_id BIGINT,
    ADD COLUMN expired_claims INTEGER NOT NULL DEFAULT 0;
UPDATE {deliveries} AS d SET aggregate_type = o.aggregate_type
FROM {outbox} AS o WHERE o.id = d.event_id;
-- Relays of earlier versions claim deliveries by this column: dropping it stops them (their
-- claims fail) instead of letting them claim without a token.
ALTER TABLE {deliveries} ALTER COLUMN aggregate_type SET NOT NULL,
    DROP COLUMN claimed_until;
CREATE INDEX {deliveries_claim_idx} ON {deliveries} (claim_id) WHERE claim_id IS NOT NULL;
