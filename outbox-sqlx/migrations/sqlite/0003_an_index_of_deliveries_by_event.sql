-- Deleting an event (retention) checks that no delivery refers to it: without this index, by a
-- scan of every delivery per deleted event.
CREATE INDEX {deliveries_event_idx} ON {deliveries} (event_id);
