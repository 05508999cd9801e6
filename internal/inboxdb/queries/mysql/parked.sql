-- The operators' side of the table of parked messages (parked.go) and the
-- park itself (claim.go), on MySQL/MariaDB.
--
-- Run-time templates: a filter's statements have one hole, Where
-- (parkedWhereMySQL: the conditions of the fields set). MySQL numbers no
-- placeholders: the arguments go in the order of the ? in the text, so
-- a statement's own parameters before the hole come first, then the
-- filter's, then those after it (the LIMIT). Parked order: oldest parked
-- first, then consumer and key, byte order (VARBINARY).

-- name: FindParked
SELECT {{.Frag.ParkedColumns}}, NULL, {{.Frag.ParkedRest}}, COALESCE(i.status, '')
FROM (SELECT p.* FROM {{.Parked}} p WHERE {{.Run "Where"}} ORDER BY p.parked_at, p.consumer, p.message_key LIMIT ?) p
LEFT JOIN {{.Inbox}} i ON i.consumer = p.consumer AND i.message_key = p.message_key
ORDER BY p.parked_at, p.consumer, p.message_key

-- name: FindParkedPayloads
SELECT {{.Frag.ParkedColumns}}, p.payload, {{.Frag.ParkedRest}}, COALESCE(i.status, '')
FROM (SELECT p.* FROM {{.Parked}} p WHERE {{.Run "Where"}} ORDER BY p.parked_at, p.consumer, p.message_key LIMIT ?) p
LEFT JOIN {{.Inbox}} i ON i.consumer = p.consumer AND i.message_key = p.message_key
ORDER BY p.parked_at, p.consumer, p.message_key

-- The page's keys first, from the (consumer, parked_at, message_key)
-- index, then their rows (see keysFirst).

-- name: FindParkedKeysFirst
SELECT {{.Frag.ParkedColumns}}, NULL, {{.Frag.ParkedRest}}, COALESCE(i.status, '')
FROM (SELECT p.consumer, p.message_key FROM {{.Parked}} p WHERE {{.Run "Where"}} ORDER BY p.parked_at, p.message_key LIMIT ?) k
JOIN {{.Parked}} p ON p.consumer = k.consumer AND p.message_key = k.message_key
LEFT JOIN {{.Inbox}} i ON i.consumer = p.consumer AND i.message_key = p.message_key
ORDER BY p.parked_at, p.consumer, p.message_key

-- name: FindParkedKeysFirstPayloads
SELECT {{.Frag.ParkedColumns}}, p.payload, {{.Frag.ParkedRest}}, COALESCE(i.status, '')
FROM (SELECT p.consumer, p.message_key FROM {{.Parked}} p WHERE {{.Run "Where"}} ORDER BY p.parked_at, p.message_key LIMIT ?) k
JOIN {{.Parked}} p ON p.consumer = k.consumer AND p.message_key = k.message_key
LEFT JOIN {{.Inbox}} i ON i.consumer = p.consumer AND i.message_key = p.message_key
ORDER BY p.parked_at, p.consumer, p.message_key

-- name: CountParked
SELECT COUNT(*) FROM {{.Parked}} p WHERE {{.Run "Where"}}

-- name: CountParkedMax
SELECT COUNT(*) FROM (SELECT 1 FROM {{.Parked}} p WHERE {{.Run "Where"}} LIMIT ?) c

-- BoundedScanCount is the bounded scan's check (at most MaxScan+1 rows of
-- the filter's indexed conditions); MySQL has no planner settings to make
-- for the read after it (PostgreSQL's BoundedScanPlanner), the second
-- column stands in for set_config's.

-- name: BoundedScanCount
SELECT COUNT(*), '' FROM (SELECT 1 FROM {{.Parked}} p WHERE {{.Run "Where"}} LIMIT ?) c

-- name: GetParked
SELECT {{.Frag.ParkedColumns}}, p.payload, {{.Frag.ParkedRest}}, COALESCE(i.status, '')
FROM {{.Parked}} p LEFT JOIN {{.Inbox}} i ON i.consumer = p.consumer AND i.message_key = p.message_key
WHERE p.consumer = ? AND p.message_key = ?

-- name: GetParkedPrefix
SELECT {{.Frag.ParkedColumns}}, SUBSTRING(p.payload, 1, ?), {{.Frag.ParkedRest}}, COALESCE(i.status, '')
FROM {{.Parked}} p LEFT JOIN {{.Inbox}} i ON i.consumer = p.consumer AND i.message_key = p.message_key
WHERE p.consumer = ? AND p.message_key = ?

-- name: LockRecordStatus
SELECT status FROM {{.Inbox}} WHERE consumer = ? AND message_key = ? FOR UPDATE

-- name: LockParkedMessage
SELECT {{.Frag.ParkedColumns}}, NULL, {{.Frag.ParkedRest}}, ''
FROM {{.Parked}} p WHERE p.consumer = ? AND p.message_key = ? AND {{.Run "Where"}} FOR UPDATE

-- name: LockParkedMessagePayload
SELECT {{.Frag.ParkedColumns}}, p.payload, {{.Frag.ParkedRest}}, ''
FROM {{.Parked}} p WHERE p.consumer = ? AND p.message_key = ? AND {{.Run "Where"}} FOR UPDATE

-- name: LockParkedUUID
SELECT message_uuid FROM {{.Parked}} WHERE consumer = ? AND message_key = ? FOR UPDATE

-- Discard (DiscardTx) is two statements in the caller's transaction: the
-- parked message's DELETE, then, when there was one, DiscardMark.

-- name: DeleteParked
DELETE FROM {{.Parked}} WHERE consumer = ? AND message_key = ?

-- name: DiscardMark
UPDATE {{.Inbox}} SET status = 'discarded', processed_at = UTC_TIMESTAMP(6)
WHERE consumer = ? AND message_key = ? AND status = 'parked'

-- A batch discard picks the page of parked messages (skipping those
-- another transaction holds), then deletes them (DeleteParked) and marks
-- (DiscardMark) or, with forget, deletes (ForgetWaitingRecord) their
-- records, one statement per key (byKey).

-- name: DiscardParkedBatch
SELECT p.consumer, p.message_key FROM {{.Parked}} p WHERE {{.Run "Where"}}
ORDER BY p.parked_at, p.consumer, p.message_key LIMIT ? FOR UPDATE SKIP LOCKED

-- A park (transactional mode) inserts the record parked, or parks a
-- released one (failed, parked by a transaction) again; any other record
-- is left as it was. MySQL assigns ON DUPLICATE KEY UPDATE's columns left
-- to right, each seeing the ones before: status, which the condition
-- reads, is set last. Affected rows: 1 inserted, 2 parked again, 0 left
-- alone; when it parked, KeepParked keeps the message from the record, in
-- the same transaction. The reason is passed twice.

-- name: Park
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, first_seen_at, processed_at, last_error, parked_by_transaction)
VALUES (?, ?, 'parked', 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), ?, TRUE)
ON DUPLICATE KEY UPDATE
attempts = IF(status = 'failed' AND parked_by_transaction, attempts + 1, attempts),
processed_at = IF(status = 'failed' AND parked_by_transaction, UTC_TIMESTAMP(6), processed_at),
last_error = IF(status = 'failed' AND parked_by_transaction, ?, last_error),
status = IF(status = 'failed' AND parked_by_transaction, 'parked', status)

-- KeepParked keeps the message (uuid, topic, payload, payload size,
-- metadata: ParkedFields.args) of the key (consumer, key after them) from
-- its parked record, replacing what an earlier park kept.

-- name: KeepParked
INSERT INTO {{.Parked}} (consumer, message_key, message_uuid, topic, payload, payload_size, metadata, reason, attempts, first_seen_at, parked_at)
SELECT consumer, message_key, ?, ?, ?, ?, ?, COALESCE(last_error, ''), attempts, first_seen_at, COALESCE(processed_at, UTC_TIMESTAMP(6))
FROM {{.Inbox}} WHERE consumer = ? AND message_key = ? AND status = 'parked'
ON DUPLICATE KEY UPDATE message_uuid = VALUES(message_uuid), topic = VALUES(topic), payload = VALUES(payload),
payload_size = VALUES(payload_size), metadata = VALUES(metadata), reason = VALUES(reason), attempts = VALUES(attempts),
first_seen_at = VALUES(first_seen_at), parked_at = VALUES(parked_at)
