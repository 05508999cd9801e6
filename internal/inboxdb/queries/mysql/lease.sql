-- Lease mode's steps on MySQL/MariaDB (lease.go), the same outcomes as
-- queries/postgres/lease.sql. MySQL has no RETURNING: a claim locks the
-- key's record (LeaseInsert) and reads it back (LeaseLockRecord), and each
-- change is an UPDATE followed by a read (LeaseRecord) in the claim's
-- transaction. Parameters are positional: the statements that change a
-- record take their values first and the key (consumer, message_key, then
-- the fencing token where there is one) last. Times are DATETIME(6) in
-- UTC: now is UTC_TIMESTAMP(6), a lease is a number of microseconds.
-- A park that keeps the message runs parked.sql's KeepParked after the
-- record's update, in the same transaction; Release is ops.sql's.

-- name: LeaseLockWait
-- The claim waits at most claimLockTimeout (1 s, InnoDB's least) for a
-- record another transaction holds; the session's setting is kept in a
-- user variable and put back by LeaseLockWaitRestore before the claim
-- commits.
SET @eo_lock_wait = @@SESSION.innodb_lock_wait_timeout, SESSION innodb_lock_wait_timeout = 1

-- name: LeaseLockWaitRestore
SET SESSION innodb_lock_wait_timeout = @eo_lock_wait

-- name: LeaseInsert
-- Inserts the key's record as processing, attempt 1, or, when it exists,
-- takes its row lock (the no-op update): either way the claim holds the
-- record. The caller tells which by the token LeaseLockRecord reads.
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, lease_until, lease_token, first_seen_at)
VALUES (?, ?, 'processing', 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?, UTC_TIMESTAMP(6))
ON DUPLICATE KEY UPDATE status = status

-- name: LeaseLockRecord
SELECT {{.Frag.RecordColumns}}, lease_until IS NULL OR lease_until < UTC_TIMESTAMP(6), coalesce(lease_token, '')
FROM {{.Inbox}} WHERE consumer = ? AND message_key = ? FOR UPDATE

-- name: LeaseRecord
SELECT {{.Frag.RecordColumns}} FROM {{.Inbox}} WHERE consumer = ? AND message_key = ?

-- name: LeaseCountDuplicate
UPDATE {{.Inbox}} SET duplicates = duplicates + 1
WHERE consumer = ? AND message_key = ?

-- name: LeaseRetry
UPDATE {{.Inbox}} SET status = 'processing', attempts = attempts + 1, lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,
lease_token = ?, interrupted = FALSE
WHERE consumer = ? AND message_key = ?

-- name: LeaseRetryInterrupted
UPDATE {{.Inbox}} SET status = 'processing', attempts = attempts + 1, lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND,
lease_token = ?, interrupted = FALSE, interruptions = interruptions + 1
WHERE consumer = ? AND message_key = ?

-- name: LeasePark
UPDATE {{.Inbox}} SET status = 'parked', lease_until = NULL, lease_token = NULL, interrupted = TRUE,
interruptions = interruptions + 1, processed_at = UTC_TIMESTAMP(6), last_error = ?
WHERE consumer = ? AND message_key = ?

-- name: ExtendLease
UPDATE {{.Inbox}} SET lease_until = UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND
WHERE consumer = ? AND message_key = ? AND status = 'processing' AND lease_token = ?

-- name: LeaseUntilOf
-- The lease end ExtendLease wrote: a locking read, so that it sees the
-- latest record (not a REPEATABLE READ snapshot) and the attempt's own
-- write.
SELECT lease_until FROM {{.Inbox}}
WHERE consumer = ? AND message_key = ? AND status = 'processing' AND lease_token = ? FOR UPDATE

-- name: CompleteLease
UPDATE {{.Inbox}}
SET status = 'done', processed_at = UTC_TIMESTAMP(6), lease_until = NULL, lease_token = NULL, last_error = NULL
WHERE consumer = ? AND message_key = ? AND status = 'processing' AND lease_token = ?

-- name: Owns
SELECT count(*) FROM {{.Inbox}}
WHERE consumer = ? AND message_key = ? AND status = 'processing' AND lease_token = ?

-- name: FinishFailed
UPDATE {{.Inbox}}
SET status = 'failed', last_error = ?, lease_until = NULL, lease_token = NULL, processed_at = UTC_TIMESTAMP(6)
WHERE consumer = ? AND message_key = ? AND status = 'processing' AND lease_token = ?

-- name: FinishParked
UPDATE {{.Inbox}}
SET status = 'parked', last_error = ?, lease_until = NULL, lease_token = NULL, processed_at = UTC_TIMESTAMP(6)
WHERE consumer = ? AND message_key = ? AND status = 'processing' AND lease_token = ?

-- name: FinishInterrupted
UPDATE {{.Inbox}}
SET status = 'parked', interrupted = TRUE, interruptions = interruptions + 1, last_error = ?, lease_until = NULL, lease_token = NULL,
processed_at = UTC_TIMESTAMP(6)
WHERE consumer = ? AND message_key = ? AND status = 'processing' AND lease_token = ?

-- name: ListParked
SELECT {{.Frag.RecordColumns}} FROM {{.Inbox}} WHERE status = 'parked' ORDER BY first_seen_at LIMIT ?

-- name: ListParkedOf
SELECT {{.Frag.RecordColumns}} FROM {{.Inbox}} WHERE status = 'parked' AND consumer = ? ORDER BY first_seen_at LIMIT ?
