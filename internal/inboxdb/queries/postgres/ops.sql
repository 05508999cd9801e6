-- Operations (ops.go): look-up, forget, stats, the row purge. A tenant is
-- a key prefix (starts_with). Purge ages out done, failed and discarded
-- records (a record the library finished always has processed_at;
-- first_seen_at stands in for rows written by hand).

-- name: Lookup
SELECT {{.Frag.RecordColumns}} FROM {{.Inbox}} WHERE consumer = $1 AND message_key = $2

-- name: Forget
WITH rec AS (DELETE FROM {{.Inbox}} WHERE consumer = $1 AND message_key = $2 RETURNING 1),
kept AS (DELETE FROM {{.Parked}} WHERE consumer = $1 AND message_key = $2 RETURNING 1)
SELECT EXISTS (SELECT 1 FROM rec), EXISTS (SELECT 1 FROM kept)

-- name: ForgetWaiting
WITH rec AS (DELETE FROM {{.Inbox}} WHERE consumer = $1 AND message_key = $2 AND status IN ('parked', 'failed') RETURNING 1),
kept AS (DELETE FROM {{.Parked}} WHERE consumer = $1 AND message_key = $2 RETURNING 1)
SELECT EXISTS (SELECT 1 FROM rec), EXISTS (SELECT 1 FROM kept)

-- name: Stats
SELECT status, count(*), coalesce(sum(duplicates), 0)::bigint, min(first_seen_at) FROM {{.Inbox}}
GROUP BY status

-- name: StatsOf
SELECT status, count(*), coalesce(sum(duplicates), 0)::bigint, min(first_seen_at) FROM {{.Inbox}}
WHERE consumer = $1
GROUP BY status

-- name: StatsOfTenant
SELECT status, count(*), coalesce(sum(duplicates), 0)::bigint, min(first_seen_at) FROM {{.Inbox}}
WHERE starts_with(message_key, $1)
GROUP BY status

-- name: StatsOfConsumerTenant
SELECT status, count(*), coalesce(sum(duplicates), 0)::bigint, min(first_seen_at) FROM {{.Inbox}}
WHERE consumer = $1 AND starts_with(message_key, $2)
GROUP BY status

-- name: CountDone
SELECT count(*) FROM {{.Inbox}} WHERE status = 'done'

-- name: CountDoneOf
SELECT count(*) FROM {{.Inbox}} WHERE status = 'done' AND consumer = $1

-- name: CountOpen
SELECT count(*) FROM {{.Inbox}} WHERE status = $1 AND status <> 'done'

-- name: CountOpenOf
SELECT count(*) FROM {{.Inbox}} WHERE status = $1 AND status <> 'done' AND consumer = $2

-- name: KnownConsumer
SELECT EXISTS (SELECT 1 FROM {{.Inbox}} WHERE consumer = $1)
    OR EXISTS (SELECT 1 FROM {{.Parked}} WHERE consumer = $1)

-- name: Now
SELECT now()

-- name: Consumers
WITH RECURSIVE c AS (
    (SELECT consumer FROM {{.Inbox}} ORDER BY consumer LIMIT 1)
  UNION ALL
    SELECT (SELECT t.consumer FROM {{.Inbox}} t WHERE t.consumer > c.consumer ORDER BY t.consumer LIMIT 1)
    FROM c WHERE c.consumer IS NOT NULL
)
SELECT consumer FROM c WHERE consumer IS NOT NULL LIMIT $1

-- name: ParkedConsumers
WITH RECURSIVE c AS (
    (SELECT consumer FROM {{.Parked}} ORDER BY consumer LIMIT 1)
  UNION ALL
    SELECT (SELECT t.consumer FROM {{.Parked}} t WHERE t.consumer > c.consumer ORDER BY t.consumer LIMIT 1)
    FROM c WHERE c.consumer IS NOT NULL
)
SELECT consumer FROM c WHERE consumer IS NOT NULL LIMIT $1

-- name: PurgeLock
SELECT pg_try_advisory_xact_lock({{.PurgeLockClass}}, hashtext('{{.Inbox}}'))

-- name: PurgeRows
DELETE FROM {{.Inbox}} WHERE (consumer, message_key) IN (
SELECT consumer, message_key FROM {{.Inbox}} WHERE coalesce(processed_at, first_seen_at) < now() - make_interval(secs => $1) AND status IN ('done', 'failed', 'discarded')
LIMIT $2 FOR UPDATE SKIP LOCKED)

-- name: PurgeRowsOf
DELETE FROM {{.Inbox}} WHERE (consumer, message_key) IN (
SELECT consumer, message_key FROM {{.Inbox}} WHERE coalesce(processed_at, first_seen_at) < now() - make_interval(secs => $1) AND status IN ('done', 'failed', 'discarded')
AND consumer = $3
LIMIT $2 FOR UPDATE SKIP LOCKED)

-- name: PurgeRowsOfTenant
DELETE FROM {{.Inbox}} WHERE (consumer, message_key) IN (
SELECT consumer, message_key FROM {{.Inbox}} WHERE coalesce(processed_at, first_seen_at) < now() - make_interval(secs => $1) AND status IN ('done', 'failed', 'discarded')
AND starts_with(message_key, $3)
LIMIT $2 FOR UPDATE SKIP LOCKED)

-- name: PurgeRowsOfConsumerTenant
DELETE FROM {{.Inbox}} WHERE (consumer, message_key) IN (
SELECT consumer, message_key FROM {{.Inbox}} WHERE coalesce(processed_at, first_seen_at) < now() - make_interval(secs => $1) AND status IN ('done', 'failed', 'discarded')
AND consumer = $3 AND starts_with(message_key, $4)
LIMIT $2 FOR UPDATE SKIP LOCKED)
