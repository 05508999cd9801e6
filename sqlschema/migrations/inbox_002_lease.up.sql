-- Lease mode: the latest attempt was cut off by its lease expiring, so
-- whether its external effect happened is unknown. Kept when the key is
-- parked and released, so that the released attempt is told.
ALTER TABLE {{.Inbox}} ADD COLUMN IF NOT EXISTS interrupted boolean NOT NULL DEFAULT false;

-- Lease mode's open records (processing, failed, parked) are few; this
-- partial index finds them (parked keys for operators, metrics) without
-- scanning the table. Transactional mode inserts only 'done' rows, which
-- the index skips, so its hot path does not pay for it.
CREATE INDEX IF NOT EXISTS {{.InboxIndex "open"}}
    ON {{.Inbox}} (status, consumer) WHERE status <> 'done';
