-- Purges go through old published events in this order, from where the last one stopped:
-- each reads a batch, whatever else the table keeps.
CREATE INDEX {published_idx} ON {outbox} (published_at, id) WHERE published_at IS NOT NULL;
