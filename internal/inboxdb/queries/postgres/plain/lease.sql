-- The plain layout's lease claim insert and park (lease.go, claim.go). The
-- kept message of a park is always $1..$5 (.Frag.KeepParked).

-- name: LeaseInsert
WITH lock_wait AS (SELECT set_config('lock_timeout', $5, true))
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, lease_until, lease_token)
SELECT $1, $2, 'processing', 1, now() + make_interval(secs => $3), $4::uuid FROM lock_wait
ON CONFLICT (consumer, message_key) DO NOTHING
RETURNING {{.Frag.RecordColumns}}

-- name: Park
INSERT INTO {{.Inbox}} AS t (consumer, message_key, status, attempts, processed_at, last_error, parked_by_transaction)
VALUES ($1, $2, 'parked', 1, now(), $3, true)
ON CONFLICT (consumer, message_key) DO UPDATE SET status = 'parked', attempts = t.attempts + 1, processed_at = now(),
last_error = EXCLUDED.last_error WHERE t.status = 'failed' AND t.parked_by_transaction

-- name: ParkKeep
WITH parked AS (INSERT INTO {{.Inbox}} AS t (consumer, message_key, status, attempts, processed_at, last_error, parked_by_transaction)
VALUES ($6, $7, 'parked', 1, now(), $8, true)
ON CONFLICT (consumer, message_key) DO UPDATE SET status = 'parked', attempts = t.attempts + 1, processed_at = now(),
last_error = EXCLUDED.last_error WHERE t.status = 'failed' AND t.parked_by_transaction
RETURNING {{.Frag.ParkedReturning}})
{{.Frag.KeepParked}}
