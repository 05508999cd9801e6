-- Per-key order (docs/ordering.md). A row written with an ordering key is
-- relayed only after every earlier row of its key (lower id) was confirmed
-- by the broker and deleted. Writers of one key are serialized by a
-- transaction-level advisory lock taken before the INSERT, so the ids of a
-- key follow the commits of its transactions. NULL: no key, relayed as
-- before (in no particular order).
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS ordering_key text;
-- Is there an earlier row of this key? The relay asks it of the rows of
-- each batch (a range of this index between two rows of one key).
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "ordering_key"}} ON {{.Outbox}} (ordering_key, id) WHERE ordering_key IS NOT NULL;
-- Is this row behind a failing or quarantined row of its key? The relay
-- asks it of every row it scans for a batch, so that the rows waiting behind
-- a blocked key do not take the batch's room. Few entries: the failed rows
-- that have a key.
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "ordering_key_failed"}} ON {{.Outbox}} (ordering_key, id) WHERE ordering_key IS NOT NULL AND failures > 0;
