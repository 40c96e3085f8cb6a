-- An event set aside behind a claim that lasted (`held_by`) waits until that claim is over or
-- lets go of the event's aggregate: a record of part of a claim takes whole aggregates out of
-- it. `events` is how many events the claim listed when events were last set aside behind it;
-- a claim that finds the claim listing fewer releases what it held (what still waits is set
-- aside again by the next claim). NULL for holds written before this migration: those wait
-- for their claim's end, as they did.
ALTER TABLE {holds} ADD COLUMN events INTEGER;
