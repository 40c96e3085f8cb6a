-- A record of part of a claim (`Store::record_part`) takes the events it names out of the
-- claim. It rewrote the claim's three arrays, a read and a write of the whole claim for each
-- part; it now adds one row here, with the events it took out, and every reader of a claim's
-- lists leaves them out. The rows go with their claim (its record, or its expiry, deletes
-- them). Read by claim, by index, as the claims table is.
CREATE TABLE {claim_parts} (claim_id BIGINT NOT NULL, event_ids BIGINT[] NOT NULL);
CREATE INDEX {claim_parts_idx} ON {claim_parts} (claim_id);
