-- Operations (ops.go): look-up, forget, stats, the row purge, on
-- MySQL/MariaDB. A tenant is a key prefix: message_key LIKE ? ESCAPE '!'
-- with the prefix escaped (likePrefix), which reads the primary key's
-- range. Purge ages out done, failed and discarded records (a record the
-- library finished always has processed_at; first_seen_at stands in for
-- rows written by hand).

-- name: Lookup
SELECT {{.Frag.RecordColumns}} FROM {{.Inbox}} WHERE consumer = ? AND message_key = ?

-- Forget is two statements in one transaction: the record first, then the
-- parked message (the lock order of parked.go).

-- name: ForgetRecord
DELETE FROM {{.Inbox}} WHERE consumer = ? AND message_key = ?

-- name: ForgetWaitingRecord
DELETE FROM {{.Inbox}} WHERE consumer = ? AND message_key = ? AND status IN ('parked', 'failed')

-- name: Release
UPDATE {{.Inbox}} SET status = 'failed', processed_at = UTC_TIMESTAMP(6)
WHERE consumer = ? AND message_key = ? AND status = 'parked'

-- name: Stats
SELECT status, COUNT(*), CAST(COALESCE(SUM(duplicates), 0) AS SIGNED), MIN(first_seen_at) FROM {{.Inbox}}
GROUP BY status

-- name: StatsOf
SELECT status, COUNT(*), CAST(COALESCE(SUM(duplicates), 0) AS SIGNED), MIN(first_seen_at) FROM {{.Inbox}}
WHERE consumer = ?
GROUP BY status

-- name: StatsOfTenant
SELECT status, COUNT(*), CAST(COALESCE(SUM(duplicates), 0) AS SIGNED), MIN(first_seen_at) FROM {{.Inbox}}
WHERE message_key LIKE ? ESCAPE '!'
GROUP BY status

-- name: StatsOfConsumerTenant
SELECT status, COUNT(*), CAST(COALESCE(SUM(duplicates), 0) AS SIGNED), MIN(first_seen_at) FROM {{.Inbox}}
WHERE consumer = ? AND message_key LIKE ? ESCAPE '!'
GROUP BY status

-- name: CountDone
SELECT COUNT(*) FROM {{.Inbox}} WHERE status = 'done'

-- name: CountDoneOf
SELECT COUNT(*) FROM {{.Inbox}} WHERE status = 'done' AND consumer = ?

-- name: CountOpen
SELECT COUNT(*) FROM {{.Inbox}} WHERE status = ? AND status <> 'done'

-- name: CountOpenOf
SELECT COUNT(*) FROM {{.Inbox}} WHERE status = ? AND status <> 'done' AND consumer = ?

-- name: KnownConsumer
SELECT EXISTS (SELECT 1 FROM {{.Inbox}} WHERE consumer = ?)
    OR EXISTS (SELECT 1 FROM {{.Parked}} WHERE consumer = ?)

-- Now is the statement's time (PostgreSQL's now() is the transaction's).

-- name: Now
SELECT UTC_TIMESTAMP(6)

-- The distinct consumers: a DISTINCT of the primary key's first column is
-- a loose index scan in InnoDB ("Using index for group-by").

-- name: Consumers
SELECT DISTINCT consumer FROM {{.Inbox}} ORDER BY consumer LIMIT ?

-- name: ParkedConsumers
SELECT DISTINCT consumer FROM {{.Parked}} ORDER BY consumer LIMIT ?

-- The purge lock: a named lock of the session (MySQL has no
-- transaction-scoped one), tried without waiting and released by the
-- same transaction's connection before it ends (underPurgeLock). The name
-- is a hash of the table's (names are at most 64 characters).

-- name: PurgeLock
SELECT COALESCE(GET_LOCK(?, 0), 0) = 1

-- name: PurgeUnlock
SELECT COALESCE(RELEASE_LOCK(?), 0)

-- A purge batch picks the rows (skipping those another transaction
-- holds: a claim counting a duplicate); then ForgetRecord deletes them,
-- one statement per key (byKey). The age is in microseconds.

-- name: PurgePick
SELECT consumer, message_key FROM {{.Inbox}}
WHERE COALESCE(processed_at, first_seen_at) < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND status IN ('done', 'failed', 'discarded')
LIMIT ? FOR UPDATE SKIP LOCKED

-- name: PurgePickOf
SELECT consumer, message_key FROM {{.Inbox}}
WHERE COALESCE(processed_at, first_seen_at) < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND status IN ('done', 'failed', 'discarded')
AND consumer = ?
LIMIT ? FOR UPDATE SKIP LOCKED

-- name: PurgePickOfTenant
SELECT consumer, message_key FROM {{.Inbox}}
WHERE COALESCE(processed_at, first_seen_at) < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND status IN ('done', 'failed', 'discarded')
AND message_key LIKE ? ESCAPE '!'
LIMIT ? FOR UPDATE SKIP LOCKED

-- name: PurgePickOfConsumerTenant
SELECT consumer, message_key FROM {{.Inbox}}
WHERE COALESCE(processed_at, first_seen_at) < UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND AND status IN ('done', 'failed', 'discarded')
AND consumer = ? AND message_key LIKE ? ESCAPE '!'
LIMIT ? FOR UPDATE SKIP LOCKED
