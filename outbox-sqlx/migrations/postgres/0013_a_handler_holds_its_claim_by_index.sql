-- A handler holds the claim of its delivery (`Outbox::hold_claim`, `Outbox::handle_once`) in its
-- own transaction, where no setting may be left behind for the statements after it. The claim
-- is looked up here, in a function whose plan is made without sequential scans (its settings
-- end with it): the statement, prepared once per pooled connection, kept its plan, and a plan
-- made while the claims table was empty (as a vacuum leaves it) read the whole table at every
-- hold once claims piled up (a session holding an old snapshot keeps every ended claim).
CREATE FUNCTION {schema}.{hold_claim}(claim bigint) RETURNS boolean LANGUAGE plpgsql VOLATILE
    SET enable_seqscan = off AS $$
BEGIN
    PERFORM 1 FROM {claims} WHERE id = claim AND until >= clock_timestamp() FOR KEY SHARE;
    RETURN FOUND;
END $$;
