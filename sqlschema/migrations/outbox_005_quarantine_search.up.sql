-- Finding quarantined rows (outbox.FindRows, CountRows, RequeueMatching,
-- DiscardMatching): by time, by message UUID, and by a metadata field such as
-- a business id (metadata @> a JSON object of the fields sought). Each index
-- is partial, over the quarantined rows only: the relay's inserts and
-- deletes (quarantined_at NULL) add no entry to any of them, and the set is
-- the few rows the broker refused for good. The other filters (topic, reason
-- text, ids) read the quarantined rows through the first index. Failing rows
-- not quarantined are found through outbox_004's partial index.
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "quarantined_at"}} ON {{.Outbox}} (quarantined_at) WHERE quarantined_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "quarantined_uuid"}} ON {{.Outbox}} (uuid) WHERE quarantined_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "quarantined_metadata"}} ON {{.Outbox}} USING gin (metadata jsonb_path_ops) WHERE quarantined_at IS NOT NULL;
