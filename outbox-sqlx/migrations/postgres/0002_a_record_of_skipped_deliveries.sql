CREATE TABLE {skips} (
    event_id    BIGINT NOT NULL,
    subscriber  TEXT,
    attempts    INTEGER NOT NULL,
    last_error  TEXT,
    reason      TEXT NOT NULL,
    skipped_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);
COMMENT ON TABLE {skips} IS
    'deliveries an operator gave up on; subscriber NULL: the whole event, for every subscriber';
