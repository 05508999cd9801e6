-- The transactional claims (claim.go, claim_batch.go) on MySQL/MariaDB
-- (InnoDB). No RETURNING: an INSERT ... ON DUPLICATE KEY UPDATE tells by
-- its affected rows whether it inserted (1), changed the existing row (2)
-- or left it as it was (0), and takes the row's exclusive lock either way,
-- waiting for another transaction's uncommitted insert of the key; the
-- record is then read with a locking read (FOR UPDATE), which reads the
-- latest committed row also under REPEATABLE READ. The statuses a
-- duplicate counts on are Settled's: done, parked, discarded.

-- name: ClaimInsert
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, first_seen_at, processed_at)
VALUES (?, ?, 'done', 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))
ON DUPLICATE KEY UPDATE duplicates = duplicates + IF({{.Frag.SettledStatus}}, 1, 0)

-- name: Reclaim
UPDATE {{.Inbox}} SET status = 'done', attempts = attempts + 1, processed_at = UTC_TIMESTAMP(6),
lease_until = NULL, lease_token = NULL, last_error = NULL
WHERE consumer = ? AND message_key = ? AND status = 'failed' AND parked_by_transaction

-- name: LockRecord
SELECT {{.Frag.RecordColumns}} FROM {{.Inbox}} WHERE consumer = ? AND message_key = ? FOR UPDATE

-- ClaimBatchInsert is a run-time template: Rows is ClaimBatchRow once per
-- key, comma-separated, the keys in sorted order (InnoDB inserts and locks
-- them in that order, so two batches sharing keys do not deadlock). Each
-- row is (consumer, key, -copies): a record this statement creates holds
-- the negated count of its copies until ClaimBatchFix, which tells the
-- transaction's own new records (the only ones with a negative count:
-- invisible to others until it commits) from the others'. A record that
-- existed counts copies duplicates when settled, copies-1 when it is a
-- released transactional park (claimed again by Reclaim), none otherwise.
-- VALUES(duplicates) is the row's -copies (MySQL 8.0.20 deprecates
-- VALUES() in favour of a row alias that MariaDB lacks; both accept it).

-- name: ClaimBatchRow
(?, ?, 'done', 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), ?)

-- name: ClaimBatchInsert
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, first_seen_at, processed_at, duplicates)
VALUES {{.Run "Rows"}}
ON DUPLICATE KEY UPDATE duplicates = duplicates + IF({{.Frag.SettledStatus}}, -VALUES(duplicates),
IF(status = 'failed' AND parked_by_transaction, -VALUES(duplicates) - 1, 0))

-- ClaimBatchLock reads the batch's records back, locked (the insert above
-- holds their locks already): Reads is ClaimBatchLockOne once per key,
-- joined by UNION ALL. One point read per key, not an IN list: under
-- REPEATABLE READ InnoDB scans an IN list of three keys or more as a range
-- and locks the gaps around the batch's keys until COMMIT, and another
-- instance's batch of other keys of the consumer waits for it
-- (exactlyonce's TestBatchDisjointKeysDoNotWait). A point read of a unique
-- key locks the record only.

-- name: ClaimBatchLock
{{.Run "Reads"}}

-- name: ClaimBatchLockOne
-- (a part of ClaimBatchLock: nothing may follow it here, not even a
-- comment, which would swallow the next part)
(SELECT {{.Frag.RecordColumns}} FROM {{.Inbox}} WHERE consumer = ? AND message_key = ? FOR UPDATE)

-- name: ClaimBatchFix
-- An inserted record's count (copies-1), one record by its key (a point
-- update, for the same reason).
UPDATE {{.Inbox}} SET duplicates = -duplicates - 1
WHERE consumer = ? AND message_key = ? AND duplicates < 0
