-- Per-key order (docs/ordering.md). A row written with an ordering key is
-- relayed only after every earlier row of its key (lower id) was confirmed
-- by the broker and deleted. Writers of one key are serialized by a
-- transaction-level advisory lock that the INSERT takes before it draws the
-- ids, so the ids of a key follow the commits of its transactions (with the
-- id sequence's CACHE 1, the default). NULL: no key, relayed as
-- before (in no particular order).
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS ordering_key text;
-- Is there an earlier row of this key? The relay asks it of each row it
-- walks for a batch (only a key's first row left, its head, is taken), and
-- takes the rows right after the heads from it.
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "ordering_key"}} ON {{.Outbox}} (ordering_key, id) WHERE ordering_key IS NOT NULL;
-- The keys blocked by a failing or quarantined row, and the first such row
-- of each (outbox.PendingStats): few entries, the failed rows that have a
-- key.
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "ordering_key_failed"}} ON {{.Outbox}} (ordering_key, id) WHERE ordering_key IS NOT NULL AND failures > 0;
