-- The relay's scan of pending events starts at a floor, below which no event is pending nor
-- can become pending again unannounced (`EventFloor` in postgres.rs, ARCHITECTURE.md): a
-- session that holds an old snapshot keeps the index entries of every event published since,
-- and a scan from the lowest id read them all on every claim.
--
-- A floor is sound only if a transaction has its transaction id before it draws an event id
-- (a claim then counts it as running until it ends). `nextval` takes none (but for one draw in
-- 32): the id's default takes the transaction id first, for every insert, by this crate, by
-- a build of it before this migration, or by SQL by hand.
SELECT '{id_seq}'::regclass;
CREATE FUNCTION {schema}.{next_id}() RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM pg_current_xact_id();
    RETURN nextval('{id_seq}');
END $$;
ALTER TABLE {outbox} ALTER COLUMN id SET DEFAULT {schema}.{next_id}();
-- What waits for a time or for a claim and comes back, parked events and events held by a
-- claim, keeps the floor below it: its lowest id in one probe.
CREATE INDEX {waiting_idx} ON {outbox} (id)
    WHERE published_at IS NULL AND dead_at IS NULL
      AND (next_retry_at IS NOT NULL OR held_by IS NOT NULL);
-- Moved by every transaction that puts events back among the pending ones that may lie below
-- a floor: a requeued dead event, events that were set aside behind a dead or parked event
-- (a requeue, a skip, the parked event delivered). A relay that sees it move scans from the
-- lowest id again. A sequence, not a row: it is not transactional, and moving it leaves no
-- dead row behind for an old snapshot to keep.
CREATE SEQUENCE {released};
-- Moved by the database, whoever puts events back (this crate, an older `outbox` tool, SQL
-- by hand), after the row is written: a claim that can see the event back sees it moved.
CREATE FUNCTION {schema}.{put_back}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('{released}');
    RETURN NULL;
END $$;
CREATE TRIGGER {put_back} AFTER UPDATE OF dead_at, held_behind ON {outbox}
    FOR EACH ROW
    WHEN ((OLD.dead_at IS NOT NULL AND NEW.dead_at IS NULL)
          OR (OLD.held_behind IS NOT NULL AND NEW.held_behind IS NULL))
    EXECUTE FUNCTION {schema}.{put_back}();
