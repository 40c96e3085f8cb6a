-- Requeues made with a reason (`Outbox::requeue_because`, `outbox requeue --reason`, the
-- console): what was named, how many rows went back, and why. Requeues without a reason (from
-- code) are not recorded.
CREATE TABLE {requeues} (
    id           BIGSERIAL PRIMARY KEY,
    event_ids    BIGINT[],
    subscriber   TEXT,
    first_line   TEXT,
    requeued     BIGINT NOT NULL,
    reason       TEXT NOT NULL,
    requeued_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
COMMENT ON TABLE {requeues} IS
    'requeues an operator made with a reason: event_ids, or a subscriber (and first_line: one failure group), or first_line alone (undecodable events)';
