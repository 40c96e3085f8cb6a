-- Deliveries an operator gave up on; subscriber NULL: the whole event, for every subscriber.
CREATE TABLE {skips} (
    event_id    INTEGER NOT NULL,
    subscriber  TEXT,
    attempts    INTEGER NOT NULL,
    last_error  TEXT,
    reason      TEXT NOT NULL,
    skipped_at  INTEGER NOT NULL
);
