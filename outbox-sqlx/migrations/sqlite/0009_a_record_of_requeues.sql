-- Requeues made with a reason (`Outbox::requeue_because`, `outbox requeue --reason`, the
-- console): what was named (event ids as a JSON array; or a subscriber, and a failure's first
-- line; or a first line alone: undecodable events), how many rows went back, and why.
CREATE TABLE {requeues} (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    event_ids    TEXT,
    subscriber   TEXT,
    first_line   TEXT,
    requeued     INTEGER NOT NULL,
    reason       TEXT NOT NULL,
    requeued_at  INTEGER NOT NULL
);
