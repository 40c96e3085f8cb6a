-- The inbox: the messages each consumer handled, written in the transaction of the handling's
-- effects, so that a message handled again (a redelivery, a webhook sent twice) is known to be
-- a duplicate. Retention deletes the old rows by `handled_at` (microseconds since the epoch).
CREATE TABLE {inbox} (
    consumer TEXT NOT NULL,
    message_id TEXT NOT NULL,
    handled_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX {inbox_handled_idx} ON {inbox} (handled_at);
