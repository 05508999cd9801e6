-- The encoding of the idempotency key (Info.IdempotencyKey) that a record's
-- attempts pass to providers: 2 is the encoding that cannot collide across
-- consumers; NULL marks a record an earlier version created, whose attempts
-- keep the former <consumer>:<key> (the two differ only for a consumer
-- whose name contains a colon or is sha256). Lease claims write it when
-- they create a record, and Park when it creates one; the transactional
-- claim does not (its record never outlives a failed attempt). No default:
-- adding the column rewrites nothing, and the rows already there read NULL.
ALTER TABLE {{.Inbox}} ADD COLUMN IF NOT EXISTS idempotency_key_format smallint;
