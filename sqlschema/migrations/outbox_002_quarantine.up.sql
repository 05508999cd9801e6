-- A row whose publish fails on its own while other rows of its batch are
-- published counts an attempt; at RelayConfig.MaxAttempts it is quarantined
-- (skipped by the relay, reported by PendingStats) instead of blocking the
-- rows behind it forever.
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS attempts integer NOT NULL DEFAULT 0;
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS last_error text;
