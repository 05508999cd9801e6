-- The partitioned layout's statements that create a record of a key, or
-- lock for one (lockPlan). Each is rendered twice: as written, for a write
-- at clock_timestamp(), and with .Fallback (name + "Fallback"), for a
-- fallback write into the newest partition, which first takes the fallback
-- lock shared and reads the newest partition's end from the catalog
-- (.Frag.NewestEnd), or from its last parameter when a test pins it.
-- Locks in a select list are taken left to right: the fallback lock first.

-- name: ClaimLock
SELECT {{if .Fallback}}pg_advisory_xact_lock_shared({{.FallbackLockClass}}, hashtext('{{.Inbox}}')), {{end -}}
pg_advisory_xact_lock(CASE WHEN current_setting('transaction_isolation') = 'read committed' THEN {{.LockKey "$1::text" "$2::text"}} ELSE ('{{.IsolationMarker}} ' || current_setting('transaction_isolation'))::bigint END)

-- name: BeginClaimLock
BEGIN; SELECT {{if .Fallback}}pg_advisory_xact_lock_shared({{.FallbackLockClass}}, hashtext('{{.Inbox}}')), {{end -}}
pg_advisory_xact_lock(CASE WHEN current_setting('transaction_isolation') = 'read committed' THEN {{.LockKey (printf "'%s'" (.Run "Consumer")) (printf "'%s'" (.Run "Key"))}} ELSE ('{{.IsolationMarker}} ' || current_setting('transaction_isolation'))::bigint END)

-- name: ClaimInsert
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, processed_at, partition_at)
SELECT $1, $2, 'done', 1, now(), {{if .Fallback}}least(clock_timestamp(), coalesce($3::timestamptz, {{.Frag.NewestEnd}}) - interval '1 microsecond'){{else}}clock_timestamp(){{end}}
WHERE NOT EXISTS (SELECT 1 FROM {{.Inbox}} WHERE consumer = $1 AND message_key = $2)
RETURNING first_seen_at

-- name: ClaimBatchLock
SELECT pg_advisory_xact_lock(CASE WHEN current_setting('transaction_isolation') = 'read committed' THEN h ELSE ('{{.IsolationMarker}} ' || current_setting('transaction_isolation'))::bigint END)
FROM (SELECT DISTINCT {{.LockKey "$1::text" "v.k"}} AS h FROM unnest($2::text[]) v(k) ORDER BY 1) l
{{- if .Fallback}} WHERE (SELECT pg_advisory_xact_lock_shared({{.FallbackLockClass}}, hashtext('{{.Inbox}}'))) IS NOT NULL{{end}}

-- name: ClaimBatchInsert
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, processed_at, partition_at)
SELECT $1, v.k, 'done', 1, now(), {{if .Fallback}}least(clock_timestamp(), coalesce($3::timestamptz, {{.Frag.NewestEnd}}) - interval '1 microsecond'){{else}}clock_timestamp(){{end}}
FROM unnest($2::text[]) WITH ORDINALITY v(k, i)
WHERE NOT EXISTS (SELECT 1 FROM {{.Inbox}} t WHERE t.consumer = $1 AND t.message_key = v.k)
ORDER BY v.i
RETURNING message_key

-- name: LeaseLock
SELECT {{if .Fallback}}pg_advisory_xact_lock_shared({{.FallbackLockClass}}, hashtext('{{.Inbox}}')), {{end -}}
set_config('lock_timeout', $3, true), pg_advisory_xact_lock({{.LockKey "$1::text" "$2::text"}})

-- name: LeaseInsert
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, lease_until, lease_token, partition_at)
SELECT $1, $2, 'processing', 1, now() + make_interval(secs => $3), $4::uuid, {{if .Fallback}}least(clock_timestamp(), coalesce($5::timestamptz, {{.Frag.NewestEnd}}) - interval '1 microsecond'){{else}}clock_timestamp(){{end}}
WHERE NOT EXISTS (SELECT 1 FROM {{.Inbox}} WHERE consumer = $1 AND message_key = $2)
RETURNING {{.Frag.RecordColumns}}

-- name: ParkLock
SELECT {{if .Fallback}}pg_advisory_xact_lock_shared({{.FallbackLockClass}}, hashtext('{{.Inbox}}')), {{end -}}
pg_advisory_xact_lock({{.LockKey "$1::text" "$2::text"}})

-- name: Park
WITH released AS (
UPDATE {{.Inbox}} SET status = 'parked', attempts = attempts + 1, processed_at = now(), last_error = $3
WHERE consumer = $1 AND message_key = $2 AND status = 'failed' AND parked_by_transaction RETURNING {{.Frag.ParkedReturning}}),
created AS (
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, processed_at, last_error, parked_by_transaction, partition_at)
SELECT $1, $2, 'parked', 1, now(), $3, true, {{if .Fallback}}least(clock_timestamp(), coalesce($4::timestamptz, {{.Frag.NewestEnd}}) - interval '1 microsecond'){{else}}clock_timestamp(){{end}}
WHERE NOT EXISTS (SELECT 1 FROM {{.Inbox}} WHERE consumer = $1 AND message_key = $2) RETURNING {{.Frag.ParkedReturning}})
SELECT 1

-- name: ParkKeep
WITH released AS (
UPDATE {{.Inbox}} SET status = 'parked', attempts = attempts + 1, processed_at = now(), last_error = $8
WHERE consumer = $6 AND message_key = $7 AND status = 'failed' AND parked_by_transaction RETURNING {{.Frag.ParkedReturning}}),
created AS (
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, processed_at, last_error, parked_by_transaction, partition_at)
SELECT $6, $7, 'parked', 1, now(), $8, true, {{if .Fallback}}least(clock_timestamp(), coalesce($9::timestamptz, {{.Frag.NewestEnd}}) - interval '1 microsecond'){{else}}clock_timestamp(){{end}}
WHERE NOT EXISTS (SELECT 1 FROM {{.Inbox}} WHERE consumer = $6 AND message_key = $7) RETURNING {{.Frag.ParkedReturning}}),
parked AS (SELECT * FROM released UNION ALL SELECT * FROM created)
{{.Frag.KeepParked}}
