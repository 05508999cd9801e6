-- The operators' side of the table of parked messages (parked.go).
--
-- Run-time templates: the statements of a filter (find, count, the bounded
-- scan's check, a batch discard) have one hole, Where: the conditions of
-- the filter's fields that are set (parkedWhere), with their parameters
-- after the ones the statement names ($1, the limit, or the key). The
-- planner must see only those conditions, as written, to choose the index
-- that serves them, also in a generic plan (parked_find_test.go checks
-- it): a fixed statement with every condition made optional
-- ("$n IS NULL OR ...") would be planned once for all filters.
-- Parked order: oldest parked first, then consumer and key, byte order.

-- name: FindParked
SELECT p.consumer, p.message_key, p.message_uuid, p.topic, NULL::bytea, p.payload IS NOT NULL,
p.payload_size, p.metadata::text, p.reason, p.attempts, p.first_seen_at, p.parked_at, coalesce(i.status, '')
FROM (SELECT p.* FROM {{.Parked}} p WHERE {{.Run "Where"}} ORDER BY p.parked_at, p.consumer COLLATE "C", p.message_key COLLATE "C" LIMIT $1) p
LEFT JOIN {{.Inbox}} i ON i.consumer = p.consumer AND i.message_key = p.message_key
ORDER BY p.parked_at, p.consumer COLLATE "C", p.message_key COLLATE "C"

-- name: FindParkedPayloads
SELECT p.consumer, p.message_key, p.message_uuid, p.topic, p.payload, p.payload IS NOT NULL,
p.payload_size, p.metadata::text, p.reason, p.attempts, p.first_seen_at, p.parked_at, coalesce(i.status, '')
FROM (SELECT p.* FROM {{.Parked}} p WHERE {{.Run "Where"}} ORDER BY p.parked_at, p.consumer COLLATE "C", p.message_key COLLATE "C" LIMIT $1) p
LEFT JOIN {{.Inbox}} i ON i.consumer = p.consumer AND i.message_key = p.message_key
ORDER BY p.parked_at, p.consumer COLLATE "C", p.message_key COLLATE "C"

-- name: FindParkedKeysFirst
WITH page AS MATERIALIZED (SELECT p.consumer, p.message_key FROM {{.Parked}} p WHERE {{.Run "Where"}} ORDER BY p.parked_at, p.message_key COLLATE "C" LIMIT $1)
SELECT p.consumer, p.message_key, p.message_uuid, p.topic, NULL::bytea, p.payload IS NOT NULL,
p.payload_size, p.metadata::text, p.reason, p.attempts, p.first_seen_at, p.parked_at, coalesce(i.status, '')
FROM page k JOIN {{.Parked}} p ON p.consumer = k.consumer AND p.message_key = k.message_key
LEFT JOIN {{.Inbox}} i ON i.consumer = p.consumer AND i.message_key = p.message_key
ORDER BY p.parked_at, p.consumer COLLATE "C", p.message_key COLLATE "C"

-- name: FindParkedKeysFirstPayloads
WITH page AS MATERIALIZED (SELECT p.consumer, p.message_key FROM {{.Parked}} p WHERE {{.Run "Where"}} ORDER BY p.parked_at, p.message_key COLLATE "C" LIMIT $1)
SELECT p.consumer, p.message_key, p.message_uuid, p.topic, p.payload, p.payload IS NOT NULL,
p.payload_size, p.metadata::text, p.reason, p.attempts, p.first_seen_at, p.parked_at, coalesce(i.status, '')
FROM page k JOIN {{.Parked}} p ON p.consumer = k.consumer AND p.message_key = k.message_key
LEFT JOIN {{.Inbox}} i ON i.consumer = p.consumer AND i.message_key = p.message_key
ORDER BY p.parked_at, p.consumer COLLATE "C", p.message_key COLLATE "C"

-- name: CountParked
SELECT count(*) FROM {{.Parked}} p WHERE {{.Run "Where"}}

-- name: CountParkedMax
SELECT count(*) FROM (SELECT 1 FROM {{.Parked}} p WHERE {{.Run "Where"}} LIMIT $1) c

-- name: BoundedScanPlanner
SELECT set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)

-- name: BoundedScanCount
SELECT count(*), set_config('enable_indexscan', 'off', true) FROM (SELECT 1 FROM {{.Parked}} p WHERE {{.Run "Where"}} LIMIT $1) c

-- name: GetParked
SELECT p.consumer, p.message_key, p.message_uuid, p.topic, p.payload, p.payload IS NOT NULL,
p.payload_size, p.metadata::text, p.reason, p.attempts, p.first_seen_at, p.parked_at, coalesce(i.status, '')
FROM {{.Parked}} p LEFT JOIN {{.Inbox}} i ON i.consumer = p.consumer AND i.message_key = p.message_key
WHERE p.consumer = $1 AND p.message_key = $2

-- name: GetParkedPrefix
SELECT p.consumer, p.message_key, p.message_uuid, p.topic, substring(p.payload FROM 1 FOR $3), p.payload IS NOT NULL,
p.payload_size, p.metadata::text, p.reason, p.attempts, p.first_seen_at, p.parked_at, coalesce(i.status, '')
FROM {{.Parked}} p LEFT JOIN {{.Inbox}} i ON i.consumer = p.consumer AND i.message_key = p.message_key
WHERE p.consumer = $1 AND p.message_key = $2

-- name: LockRecordStatus
SELECT status FROM {{.Inbox}} WHERE consumer = $1 AND message_key = $2 FOR UPDATE

-- name: LockParkedMessage
SELECT p.consumer, p.message_key, p.message_uuid, p.topic, NULL::bytea, p.payload IS NOT NULL,
p.payload_size, p.metadata::text, p.reason, p.attempts, p.first_seen_at, p.parked_at, ''
FROM {{.Parked}} p WHERE p.consumer = $1 AND p.message_key = $2 AND {{.Run "Where"}} FOR UPDATE

-- name: LockParkedMessagePayload
SELECT p.consumer, p.message_key, p.message_uuid, p.topic, p.payload, p.payload IS NOT NULL,
p.payload_size, p.metadata::text, p.reason, p.attempts, p.first_seen_at, p.parked_at, ''
FROM {{.Parked}} p WHERE p.consumer = $1 AND p.message_key = $2 AND {{.Run "Where"}} FOR UPDATE

-- name: LockRecord
SELECT {{.Frag.RecordColumns}} FROM {{.Inbox}} WHERE consumer = $1 AND message_key = $2 FOR UPDATE

-- name: LockParkedUUID
SELECT message_uuid FROM {{.Parked}} WHERE consumer = $1 AND message_key = $2 FOR UPDATE

-- name: Discard
WITH kept AS (DELETE FROM {{.Parked}} WHERE consumer = $1 AND message_key = $2 RETURNING 1),
rec AS (UPDATE {{.Inbox}} SET status = 'discarded', processed_at = now()
  WHERE consumer = $1 AND message_key = $2 AND status = 'parked' AND EXISTS (SELECT 1 FROM kept))
SELECT EXISTS (SELECT 1 FROM kept)

-- name: DeleteParked
DELETE FROM {{.Parked}} WHERE consumer = $1 AND message_key = $2

-- name: DiscardParkedBatch
WITH d AS (DELETE FROM {{.Parked}} d USING (SELECT p.consumer, p.message_key FROM {{.Parked}} p WHERE {{.Run "Where"}}
ORDER BY p.parked_at, p.consumer COLLATE "C", p.message_key COLLATE "C" LIMIT $1 FOR UPDATE SKIP LOCKED) p
WHERE d.consumer = p.consumer AND d.message_key = p.message_key RETURNING d.consumer, d.message_key),
f AS (UPDATE {{.Inbox}} i SET status = 'discarded', processed_at = now() FROM d
  WHERE i.consumer = d.consumer AND i.message_key = d.message_key AND i.status = 'parked')
SELECT count(*) FROM d

-- name: DiscardForgetParkedBatch
WITH d AS (DELETE FROM {{.Parked}} d USING (SELECT p.consumer, p.message_key FROM {{.Parked}} p WHERE {{.Run "Where"}}
ORDER BY p.parked_at, p.consumer COLLATE "C", p.message_key COLLATE "C" LIMIT $1 FOR UPDATE SKIP LOCKED) p
WHERE d.consumer = p.consumer AND d.message_key = p.message_key RETURNING d.consumer, d.message_key),
f AS (DELETE FROM {{.Inbox}} i USING d WHERE i.consumer = d.consumer AND i.message_key = d.message_key
  AND i.status IN ('parked', 'failed'))
SELECT count(*) FROM d
