-- Lease mode: a token unique to each claim. Extension, completion and
-- failure of an attempt match it, so a stale worker can never act on a later
-- claim's row, even after Forget restarted the attempt count at 1.
ALTER TABLE {{.Inbox}} ADD COLUMN IF NOT EXISTS lease_token uuid;

-- Lease mode: how many attempts of the key ended interrupted (lease expired
-- mid-attempt, or completion failed after the handler ran). Retries stop,
-- and the key is parked, after the middleware's MaxInterruptedAttempts.
ALTER TABLE {{.Inbox}} ADD COLUMN IF NOT EXISTS interruptions integer NOT NULL DEFAULT 0;

-- Retention ages a record from when it last finished (processed_at: done,
-- failed or released), never from first sight: a key parked for days and
-- completed today must be kept as long as one completed today. Failed
-- records now carry processed_at; give the existing ones the migration time,
-- which keeps them a whole retention period (the partial index of open
-- records finds them).
UPDATE {{.Inbox}} SET processed_at = now() WHERE status = 'failed' AND processed_at IS NULL;
