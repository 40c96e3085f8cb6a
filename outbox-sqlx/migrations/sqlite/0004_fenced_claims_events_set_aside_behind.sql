-- A claim's id is its token: renewals and outcomes name it and count only while it is live.
CREATE TABLE {claims} (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    until      INTEGER NOT NULL,
    claimed_at INTEGER NOT NULL
);
-- Events held back behind an earlier event of their aggregate are set aside, out of the
-- relay's scan: behind a claim that lasted (`held_by`, released when it is over) or behind a
-- dead or parked event (`held_behind`, released when it is published, skipped or requeued).
ALTER TABLE {outbox} ADD COLUMN claim_id INTEGER;
ALTER TABLE {outbox} ADD COLUMN held_by INTEGER;
ALTER TABLE {outbox} ADD COLUMN held_behind INTEGER;
ALTER TABLE {outbox} ADD COLUMN expired_claims INTEGER NOT NULL DEFAULT 0;
ALTER TABLE {outbox} DROP COLUMN claimed_until;
DROP INDEX {pending_idx};
CREATE INDEX {pending_idx} ON {outbox} (id)
    WHERE published_at IS NULL AND dead_at IS NULL AND next_retry_at IS NULL
      AND held_by IS NULL AND held_behind IS NULL AND claim_id IS NULL;
CREATE INDEX {parked_idx} ON {outbox} (next_retry_at)
    WHERE published_at IS NULL AND dead_at IS NULL AND next_retry_at IS NOT NULL;
CREATE INDEX {held_by_idx} ON {outbox} (held_by) WHERE held_by IS NOT NULL;
CREATE INDEX {held_behind_idx} ON {outbox} (held_behind) WHERE held_behind IS NOT NULL;
CREATE INDEX {claim_idx} ON {outbox} (claim_id) WHERE claim_id IS NOT NULL;
DROP INDEX {aggregate_idx};
CREATE INDEX {aggregate_idx} ON {outbox} (aggregate_id, aggregate_type, id)
    WHERE published_at IS NULL;

ALTER TABLE {deliveries} ADD COLUMN aggregate_type TEXT NOT NULL DEFAULT '';
UPDATE {deliveries} SET aggregate_type = coalesce(
    (SELECT o.aggregate_type FROM {outbox} AS o WHERE o.id = {deliveries}.event_id), '');
ALTER TABLE {deliveries} ADD COLUMN claim_id INTEGER;
ALTER TABLE {deliveries} ADD COLUMN expired_claims INTEGER NOT NULL DEFAULT 0;
ALTER TABLE {deliveries} DROP COLUMN claimed_until;
DROP INDEX {deliveries_head_idx};
CREATE INDEX {deliveries_head_idx} ON {deliveries} (subscriber, aggregate_id, aggregate_type, event_id);
CREATE INDEX {deliveries_claim_idx} ON {deliveries} (claim_id) WHERE claim_id IS NOT NULL;
