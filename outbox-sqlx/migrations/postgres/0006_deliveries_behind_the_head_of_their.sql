-- Only the first undelivered row of a (subscriber, aggregate) key has a due time; the rows
-- behind it have none, so they are out of the due index and a claim never reads them one by
-- one. When the head is delivered, its record gives the next row its due time; a claim takes
-- a due head together with the ready rows behind it, in order.
ALTER TABLE {deliveries} ALTER COLUMN next_retry_at DROP NOT NULL,
    ALTER COLUMN next_retry_at DROP DEFAULT;
UPDATE {deliveries} AS d SET next_retry_at = NULL
WHERE d.dead_at IS NULL AND d.claim_id IS NULL
  AND EXISTS (
      SELECT 1 FROM {deliveries} AS h
      WHERE h.subscriber = d.subscriber AND h.aggregate_id = d.aggregate_id
        AND h.aggregate_type = d.aggregate_type AND h.event_id < d.event_id);
