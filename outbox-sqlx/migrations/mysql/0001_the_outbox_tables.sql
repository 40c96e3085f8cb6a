-- The same tables and semantics as on PostgreSQL and SQLite, in MySQL's dialect. Times are
-- DATETIME(6): UTC with microseconds, from the server's clock (UTC_TIMESTAMP(6)). Names are
-- compared byte for byte (utf8mb4_bin), as on the other backends.
--
-- Partial indexes do not exist here: where the other backends index only the rows a query
-- looks for (pending events, due parked events, unpublished events of an aggregate, due
-- deliveries), a generated column that is NULL for every other row is indexed, and the queries
-- name it, so that a scan reads what it looks for however many published rows the table keeps.
--
-- MySQL commits around each DDL statement: this runs outside a transaction, and every statement
-- can run again (IF NOT EXISTS, INSERT IGNORE) after a failure halfway.
CREATE TABLE IF NOT EXISTS {outbox} (
    id              BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    aggregate_type  VARCHAR(255) NOT NULL,
    aggregate_id    BINARY(16) NOT NULL,
    event_type      VARCHAR(255) NOT NULL,
    payload         LONGTEXT NOT NULL,
    occurred_at     DATETIME(6) NOT NULL,
    published_at    DATETIME(6) NULL,
    retry_count     INT NOT NULL DEFAULT 0,
    last_error      TEXT NULL,
    next_retry_at   DATETIME(6) NULL,
    dead_at         DATETIME(6) NULL,
    -- Set aside behind a claim that lasted (released when it is over) or behind a dead or
    -- parked event (released when that is published, skipped or requeued).
    held_by         BIGINT NULL,
    held_behind     BIGINT NULL,
    expired_claims  INT NOT NULL DEFAULT 0,
    -- 1 for an event the relay's scan takes, in id order (less those a live claim holds: they
    -- are in its row, not marked here, so that claiming writes no event); NULL for every other.
    pending         TINYINT AS (IF(published_at IS NULL AND dead_at IS NULL
                                   AND next_retry_at IS NULL
                                   AND held_by IS NULL AND held_behind IS NULL, 1, NULL)) VIRTUAL,
    -- When a parked event is due; NULL for every other.
    parked_until    DATETIME(6) AS (IF(published_at IS NULL AND dead_at IS NULL,
                                       next_retry_at, NULL)) VIRTUAL,
    -- 1 for an unpublished event set aside, parked or dead: when there is none (and no live
    -- claim), no pending event waits for an earlier one.
    stalled         TINYINT AS (IF(published_at IS NULL
                                   AND NOT (dead_at IS NULL AND next_retry_at IS NULL
                                            AND held_by IS NULL AND held_behind IS NULL),
                                   1, NULL)) VIRTUAL,
    -- The aggregate of an unpublished event; NULL once it is published.
    unpublished_aggregate BINARY(16) AS (IF(published_at IS NULL, aggregate_id, NULL)) VIRTUAL,
    INDEX {pending_idx} (pending, id),
    INDEX {stalled_idx} (stalled),
    INDEX {parked_idx} (parked_until),
    INDEX {aggregate_idx} (unpublished_aggregate, aggregate_type, id),
    INDEX {held_by_idx} (held_by),
    INDEX {held_behind_idx} (held_behind),
    -- Purges go through old published events in this order, from where the last one stopped.
    INDEX {published_idx} (published_at, id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Per-subscriber delivery state, for events some subscriber has not had yet. Only the first
-- undelivered row of a (subscriber, aggregate) key has a due time; the rows behind it have
-- none, so a claim never reads them one by one.
CREATE TABLE IF NOT EXISTS {deliveries} (
    event_id        BIGINT NOT NULL,
    subscriber      VARCHAR(255) NOT NULL,
    aggregate_type  VARCHAR(255) NOT NULL,
    aggregate_id    BINARY(16) NOT NULL,
    attempts        INT NOT NULL DEFAULT 0,
    last_error      TEXT NULL,
    next_retry_at   DATETIME(6) NULL,
    dead_at         DATETIME(6) NULL,
    claim_id        BIGINT NULL,
    expired_claims  INT NOT NULL DEFAULT 0,
    -- When a live delivery is due; NULL for a dead one and for one behind its key's head.
    due_at          DATETIME(6) AS (IF(dead_at IS NULL, next_retry_at, NULL)) VIRTUAL,
    PRIMARY KEY (subscriber, event_id),
    INDEX {deliveries_head_idx} (subscriber, aggregate_id, aggregate_type, event_id),
    INDEX {deliveries_aggregate_idx} (aggregate_id, aggregate_type, subscriber),
    INDEX {deliveries_due_idx} (due_at),
    INDEX {deliveries_event_idx} (event_id),
    INDEX {deliveries_claim_idx} (claim_id),
    FOREIGN KEY (event_id) REFERENCES {outbox} (id)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- A claim's id is its token: renewals and outcomes name it and count only while it is live.
-- The events it holds are listed in its row (JSON arrays): claiming writes one row, not one per
-- event, and the events are free again the moment the row is gone.
CREATE TABLE IF NOT EXISTS {claims} (
    id          BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    until       DATETIME(6) NOT NULL,
    claimed_at  DATETIME(6) NOT NULL,
    event_ids   LONGTEXT NOT NULL,
    -- The first event of each aggregate it holds ([type, id as hex, event id]): what waits
    -- behind it, found without reading the events.
    aggregates  LONGTEXT NOT NULL,
    INDEX claims_until_idx (until)
) ENGINE = InnoDB;

-- One row, locked by every claim, record, skip and requeue for the rest of its transaction:
-- one at a time, each seeing what the one before it committed.
CREATE TABLE IF NOT EXISTS {claim_lock} (
    id TINYINT NOT NULL PRIMARY KEY
) ENGINE = InnoDB;
INSERT IGNORE INTO {claim_lock} (id) VALUES (1);

-- 4 096 rows; a transaction that publishes for an aggregate locks the row of the aggregate's
-- hash before its event takes an id, until it commits. Two transactions publishing for one
-- aggregate take their ids one after the other, so within an aggregate id order is commit
-- order (InnoDB takes auto-increment ids at insert, not at commit).
CREATE TABLE IF NOT EXISTS {aggregate_locks} (
    slot SMALLINT NOT NULL PRIMARY KEY
) ENGINE = InnoDB;
INSERT IGNORE INTO {aggregate_locks} (slot)
WITH RECURSIVE s (n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM s WHERE n < 63)
SELECT a.n * 64 + b.n FROM s AS a CROSS JOIN s AS b;

-- Deliveries an operator gave up on; subscriber NULL: the whole event, for every subscriber.
CREATE TABLE IF NOT EXISTS {skips} (
    event_id    BIGINT NOT NULL,
    subscriber  VARCHAR(255) NULL,
    attempts    INT NOT NULL,
    last_error  TEXT NULL,
    reason      TEXT NOT NULL,
    skipped_at  DATETIME(6) NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- The inbox: the messages each consumer handled, written in the transaction of the handling's
-- effects. Retention deletes the old rows by `handled_at`.
CREATE TABLE IF NOT EXISTS {inbox} (
    consumer    VARCHAR(200) NOT NULL,
    message_id  VARCHAR(500) NOT NULL,
    handled_at  DATETIME(6) NOT NULL,
    PRIMARY KEY (consumer, message_id),
    INDEX {inbox_handled_idx} (handled_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- The relays at work and what each one's build routes (JSON); see the other backends.
CREATE TABLE IF NOT EXISTS {relays} (
    id             CHAR(36) NOT NULL PRIMARY KEY,
    generation     BIGINT NOT NULL,
    routing        LONGTEXT NOT NULL,
    registered_at  DATETIME(6) NOT NULL,
    seen_at        DATETIME(6) NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;

-- Requeues made with a reason: what was named (event ids as a JSON array; or a subscriber, and
-- a failure's first line; or a first line alone), how many rows went back, and why.
CREATE TABLE IF NOT EXISTS {requeues} (
    id           BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
    event_ids    LONGTEXT NULL,
    subscriber   VARCHAR(255) NULL,
    first_line   TEXT NULL,
    requeued     BIGINT NOT NULL,
    reason       TEXT NOT NULL,
    requeued_at  DATETIME(6) NOT NULL
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4 COLLATE = utf8mb4_bin;
