-- The operator's statements on one row (package outbox's Store),
-- MySQL/MariaDB.

-- name: GetRow
-- The row of the third parameter with its payload: all of it when the
-- first (and second) are NULL, else its first (second parameter) bytes,
-- the two being the same value; the prefix is cut by the server, so only
-- it travels (InnoDB reads the stored value to cut it). The columns are
-- FindRows'.
SELECT o.id, o.topic, o.uuid,
  CASE WHEN ? IS NULL THEN o.payload ELSE SUBSTRING(o.payload, 1, ?) END,
  LENGTH(o.payload), o.metadata, o.created_at, o.quarantined_at,
  o.failures, o.attempts, o.next_attempt_at, COALESCE(o.last_error, ''), COALESCE(o.ordering_key, ''),
  CASE WHEN o.ordering_key IS NOT NULL AND o.failures > 0
    THEN (SELECT COUNT(*) FROM {{.Outbox}} w WHERE w.ordering_key = o.ordering_key AND w.id > o.id) ELSE 0 END
FROM {{.Outbox}} o
WHERE o.id = ?

-- name: Now
-- The database's time: DATETIME(6) in UTC, as the relay stamps
-- quarantined_at.
SELECT UTC_TIMESTAMP(6)

-- name: LockRow
-- The row's failure record, locked for the operator's action on it.
SELECT quarantined_at, failures, attempts FROM {{.Outbox}} WHERE id = ? FOR UPDATE

-- name: RequeueRow
-- Clears the failure record of the quarantined row (locked by LockRow in
-- the same transaction); the number of rows changed is the result's rows
-- affected. MySQL has no NOTIFY: the relays find the row at their next
-- poll.
UPDATE {{.Outbox}} SET failures = 0, attempts = 0, next_attempt_at = NULL, quarantined_at = NULL, last_error = NULL
WHERE id = ? AND quarantined_at IS NOT NULL

-- name: DiscardRow
-- Deletes the quarantined row (locked by LockRow in the same transaction).
DELETE FROM {{.Outbox}} WHERE id = ? AND quarantined_at IS NOT NULL

-- name: RequeuePicked
-- The second step of a batch of RequeueMatching: clears the failure
-- records of the rows PickMatching locked, their ids a JSON array of
-- integers. The relays find them at their next poll (no NOTIFY).
UPDATE {{.Outbox}} SET failures = 0, attempts = 0, next_attempt_at = NULL, quarantined_at = NULL, last_error = NULL
WHERE id IN (SELECT j.id FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) j)

-- name: DiscardPicked
-- The second step of a batch of DiscardMatching: deletes the rows
-- PickMatching locked, their ids a JSON array of integers.
DELETE FROM {{.Outbox}}
WHERE id IN (SELECT j.id FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) j)
