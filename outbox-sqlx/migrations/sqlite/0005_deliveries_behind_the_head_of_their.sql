-- Only the first undelivered row of a (subscriber, aggregate) key has a due time; the rows
-- behind it have none, so they are out of the due index and a claim never reads them one by
-- one. When the head is delivered, its record gives the next row its due time; a claim takes
-- a due head together with the ready rows behind it, in order. (SQLite cannot drop a NOT NULL
-- constraint: the table is rebuilt.)
CREATE TABLE {deliveries_rebuilt} (
    event_id        INTEGER NOT NULL REFERENCES {outbox} (id),
    subscriber      TEXT NOT NULL,
    aggregate_type  TEXT NOT NULL,
    aggregate_id    BLOB NOT NULL,
    attempts        INTEGER NOT NULL DEFAULT 0,
    last_error      TEXT,
    next_retry_at   INTEGER,
    dead_at         INTEGER,
    claim_id        INTEGER,
    expired_claims  INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (subscriber, event_id)
);
INSERT INTO {deliveries_rebuilt} (event_id, subscriber, aggregate_type, aggregate_id, attempts,
    last_error, next_retry_at, dead_at, claim_id, expired_claims)
SELECT d.event_id, d.subscriber, d.aggregate_type, d.aggregate_id, d.attempts, d.last_error,
       CASE WHEN d.dead_at IS NULL AND d.claim_id IS NULL AND EXISTS (
                SELECT 1 FROM {deliveries} AS h
                WHERE h.subscriber = d.subscriber AND h.aggregate_id = d.aggregate_id
                  AND h.aggregate_type = d.aggregate_type AND h.event_id < d.event_id)
            THEN NULL ELSE d.next_retry_at END,
       d.dead_at, d.claim_id, d.expired_claims
FROM {deliveries} AS d;
DROP TABLE {deliveries};
ALTER TABLE {deliveries_rebuilt} RENAME TO {deliveries};
CREATE INDEX {deliveries_head_idx} ON {deliveries} (subscriber, aggregate_id, aggregate_type, event_id);
CREATE INDEX {deliveries_aggregate_idx} ON {deliveries} (aggregate_id);
CREATE INDEX {deliveries_due_idx} ON {deliveries} (next_retry_at) WHERE dead_at IS NULL;
CREATE INDEX {deliveries_event_idx} ON {deliveries} (event_id);
CREATE INDEX {deliveries_claim_idx} ON {deliveries} (claim_id) WHERE claim_id IS NOT NULL;
