-- A claim checks the aggregates that other claims hold: read here, instead of one lookup per
-- claimed event. NULL in claims written by a relay of an earlier version: those are looked up.
ALTER TABLE {claims} ADD COLUMN aggregate_ids UUID[];
-- A claim's arrays (a batch of ids) are written once and read about twice: compressing them
-- cost more than the rest of the claim's insert.
ALTER TABLE {claims} ALTER COLUMN event_ids SET STORAGE EXTERNAL,
    ALTER COLUMN aggregate_ids SET STORAGE EXTERNAL;
