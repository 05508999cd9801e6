-- Lease mode's steps (lease.go). The kept message of a park is always
-- $1..$5 (.Frag.KeepParked); the key follows it.

-- name: LeaseLockRecord
SELECT {{.Frag.RecordColumns}}, coalesce(lease_until < now(), true) FROM {{.Inbox}}
WHERE consumer = $1 AND message_key = $2 FOR UPDATE

-- name: LeaseCountDuplicate
UPDATE {{.Inbox}} SET duplicates = duplicates + 1
WHERE consumer = $1 AND message_key = $2 RETURNING {{.Frag.RecordColumns}}

-- name: LeaseRetry
UPDATE {{.Inbox}} SET status = 'processing', attempts = attempts + 1, lease_until = now() + make_interval(secs => $3),
lease_token = $4::uuid, interrupted = false
WHERE consumer = $1 AND message_key = $2 RETURNING {{.Frag.RecordColumns}}

-- name: LeaseRetryInterrupted
UPDATE {{.Inbox}} SET status = 'processing', attempts = attempts + 1, lease_until = now() + make_interval(secs => $3),
lease_token = $4::uuid, interrupted = false, interruptions = interruptions + 1
WHERE consumer = $1 AND message_key = $2 RETURNING {{.Frag.RecordColumns}}

-- name: LeasePark
UPDATE {{.Inbox}} SET status = 'parked', lease_until = NULL, lease_token = NULL, interrupted = true,
interruptions = interruptions + 1, processed_at = now(), last_error = $3
WHERE consumer = $1 AND message_key = $2 RETURNING {{.Frag.RecordColumns}}

-- name: LeaseParkKeep
WITH parked AS (UPDATE {{.Inbox}} SET status = 'parked', lease_until = NULL, lease_token = NULL, interrupted = true,
interruptions = interruptions + 1, processed_at = now(), last_error = $8
WHERE consumer = $6 AND message_key = $7 RETURNING *), kept AS ({{.Frag.KeepParked}})
SELECT {{.Frag.RecordColumns}} FROM parked

-- name: ExtendLease
UPDATE {{.Inbox}} SET lease_until = now() + make_interval(secs => $4)
WHERE consumer = $1 AND message_key = $2 AND status = 'processing' AND lease_token = $3::uuid
RETURNING lease_until

-- name: CompleteLease
UPDATE {{.Inbox}}
SET status = 'done', processed_at = now(), lease_until = NULL, lease_token = NULL, last_error = NULL
WHERE consumer = $1 AND message_key = $2 AND status = 'processing' AND lease_token = $3::uuid

-- name: Owns
SELECT count(*) FROM {{.Inbox}}
WHERE consumer = $1 AND message_key = $2 AND status = 'processing' AND lease_token = $3::uuid

-- name: FinishFailed
UPDATE {{.Inbox}}
SET status = 'failed', last_error = $4, lease_until = NULL, lease_token = NULL, processed_at = now()
WHERE consumer = $1 AND message_key = $2 AND status = 'processing' AND lease_token = $3::uuid

-- name: FinishParked
UPDATE {{.Inbox}}
SET status = 'parked', last_error = $4, lease_until = NULL, lease_token = NULL, processed_at = now()
WHERE consumer = $1 AND message_key = $2 AND status = 'processing' AND lease_token = $3::uuid

-- name: FinishParkedKeep
WITH parked AS (UPDATE {{.Inbox}}
SET status = 'parked', last_error = $9, lease_until = NULL, lease_token = NULL, processed_at = now()
WHERE consumer = $6 AND message_key = $7 AND status = 'processing' AND lease_token = $8::uuid
RETURNING {{.Frag.ParkedReturning}})
{{.Frag.KeepParked}}

-- name: FinishInterrupted
UPDATE {{.Inbox}}
SET status = 'parked', interrupted = true, interruptions = interruptions + 1, last_error = $4, lease_until = NULL, lease_token = NULL, processed_at = now()
WHERE consumer = $1 AND message_key = $2 AND status = 'processing' AND lease_token = $3::uuid

-- name: FinishInterruptedKeep
WITH parked AS (UPDATE {{.Inbox}}
SET status = 'parked', interrupted = true, interruptions = interruptions + 1, last_error = $9, lease_until = NULL, lease_token = NULL, processed_at = now()
WHERE consumer = $6 AND message_key = $7 AND status = 'processing' AND lease_token = $8::uuid
RETURNING {{.Frag.ParkedReturning}})
{{.Frag.KeepParked}}

-- name: Release
UPDATE {{.Inbox}} SET status = 'failed', processed_at = now()
WHERE consumer = $1 AND message_key = $2 AND status = 'parked'

-- name: ListParked
SELECT {{.Frag.RecordColumns}} FROM {{.Inbox}} WHERE status = 'parked' ORDER BY first_seen_at LIMIT $1

-- name: ListParkedOf
SELECT {{.Frag.RecordColumns}} FROM {{.Inbox}} WHERE status = 'parked' AND consumer = $1 ORDER BY first_seen_at LIMIT $2
