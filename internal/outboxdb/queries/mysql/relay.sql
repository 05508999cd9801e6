-- The relay's statements on MySQL 8.0.1+ / MariaDB 10.6+ (package outbox's
-- relay.go, relay_batch.go, relay_publish.go): the batch semantics of
-- queries/postgres/relay.sql (read it first), in several statements of one
-- READ COMMITTED transaction that Store.ClaimBatch runs in turn.
-- {{.Outbox}} is the outbox table, quoted and database-qualified.
--
-- Why several statements. In MySQL a locking read locks (or, with SKIP
-- LOCKED, skips) the rows its subqueries read too (MariaDB; MySQL 8 only
-- when the subquery says so): a "no earlier row of the key" test inside a
-- SELECT ... FOR UPDATE SKIP LOCKED would skip an earlier row another relay
-- has locked, and take a later row of its key for its head. So the heads
-- are decided by a non-locking read (a consistent read of the latest
-- committed rows: a row another relay holds is still there, so the rows of
-- its key behind it are no heads), and only then locked, by id, with SKIP
-- LOCKED; each locking statement re-checks the row's own state (its latest
-- version). A row decided to be a head stays one until it is locked:
-- writers of a key hold its key-lock row while they draw ids, so no
-- earlier row of a key appears after a later one is visible, and earlier
-- rows only go away.
--
-- Id lists travel as one JSON array parameter, in ascending order, read
-- with JSON_TABLE and joined to the primary key: FROM JSON_TABLE(...) j
-- STRAIGHT_JOIN {{.Outbox}} o FORCE INDEX (PRIMARY), one lookup per id in
-- the array's order. Without the hints, on a small table the optimizer
-- scans the outbox table first: a DELETE then waits for the rows other
-- relays hold, and a locking read locks every row it scans. The locking
-- statements have no ORDER BY (a sort would lock every row joined before
-- the LIMIT applies): the join follows the array's order and stops at the
-- LIMIT, and ClaimBatch sorts the rows. The
-- paused topics travel as a JSON array of strings: "not paused" is
-- JSON_CONTAINS(?, JSON_QUOTE(topic)) = 0 ('[]' when none is).

-- name: Probe
-- Does the table have a row with an ordering key? (The first column is
-- PostgreSQL's JIT setting; there is none here.)
SELECT '', EXISTS (SELECT 1 FROM {{.Outbox}} WHERE ordering_key IS NOT NULL)

-- name: FreshPlain
-- The oldest rows that never failed, not paused (? the paused topics),
-- locked: the fresh rows of a batch when the table has no keyed row (Probe
-- said so), ? rows at most: a walk of the primary key that stops at the
-- LIMIT (no sort, which would lock every row it read). FORCE INDEX (PRIMARY): on a
-- small table the optimizer would scan and sort it, locking every fresh
-- row; the primary key's walk is PostgreSQL's plan too.
SELECT id, topic, uuid, payload, metadata, failures > 0, ordering_key FROM {{.Outbox}} FORCE INDEX (PRIMARY)
WHERE failures = 0 AND quarantined_at IS NULL AND JSON_CONTAINS(?, JSON_QUOTE(topic)) = 0
ORDER BY id LIMIT ?
FOR UPDATE SKIP LOCKED

-- name: DueHeads
-- Not locking: the ids of the oldest failed rows whose backoff is over, in
-- topics not paused (?), that are unkeyed or the head of their key (no
-- earlier row of the key exists, whatever its state, locked elsewhere or
-- not), ? at most. LockDue locks the first of them it can. The failing
-- index: the failed rows, few unless the broker was down, read and sorted
-- (a non-locking read may sort); without the hint the optimizer walks the
-- quarantined_at index for its id order, over every live row. (PostgreSQL
-- has a partial index of the failed rows by id; here an index of
-- (failing, id) would need a generated column.)
SELECT id FROM {{.Outbox}} o FORCE INDEX ({{.FailingIndex}})
WHERE failures > 0 AND quarantined_at IS NULL AND (next_attempt_at IS NULL OR next_attempt_at <= UTC_TIMESTAMP(6))
  AND JSON_CONTAINS(?, JSON_QUOTE(topic)) = 0
  AND (ordering_key IS NULL OR (SELECT MIN(e.id) FROM {{.Outbox}} e WHERE e.ordering_key = o.ordering_key) = o.id)
ORDER BY id LIMIT ?

-- name: WindowHeads
-- Not locking: the fresh heads of a batch when the table has keyed rows
-- (ClaimKeyed's scan and head test): among the oldest ? ... rows that never
-- failed, are not paused (?), and are neither behind a failed row of their
-- key nor behind a head in a paused topic (the window: ? rows), the ids of
-- the unkeyed rows and of the keys' heads. LockFresh locks the first it
-- can. Parameters: the paused topics (four times), the window.
SELECT id FROM (
  SELECT id, ordering_key FROM {{.Outbox}} o
  WHERE failures = 0 AND quarantined_at IS NULL AND JSON_CONTAINS(?, JSON_QUOTE(topic)) = 0
    AND (ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {{.Outbox}} e WHERE e.ordering_key = o.ordering_key AND e.id < o.id AND e.failures > 0))
    AND (JSON_LENGTH(?) = 0 OR ordering_key IS NULL
         OR JSON_CONTAINS(?, JSON_QUOTE((SELECT e.topic FROM {{.Outbox}} e WHERE e.ordering_key = o.ordering_key ORDER BY e.id LIMIT 1))) = 0)
  ORDER BY id LIMIT ?
) w
WHERE ordering_key IS NULL OR (SELECT MIN(e.id) FROM {{.Outbox}} e WHERE e.ordering_key = w.ordering_key) = w.id
ORDER BY id

-- name: LockDue
-- Locks, SKIP LOCKED, the first ? of the failed rows whose ids are given
-- (a JSON array: DueHeads') that are still due and not paused (?).
-- Parameters: the ids, the paused topics, the limit.
SELECT o.id, o.topic, o.uuid, o.payload, o.metadata, o.failures > 0, o.ordering_key
FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) j
STRAIGHT_JOIN {{.Outbox}} o FORCE INDEX (PRIMARY) ON o.id = j.id
WHERE o.failures > 0 AND o.quarantined_at IS NULL AND (o.next_attempt_at IS NULL OR o.next_attempt_at <= UTC_TIMESTAMP(6))
  AND JSON_CONTAINS(?, JSON_QUOTE(o.topic)) = 0
LIMIT ?
FOR UPDATE SKIP LOCKED

-- name: LockFresh
-- Locks, SKIP LOCKED, the first ? of the rows whose ids are given (a JSON
-- array: WindowHeads', or the followers') that still never failed and are
-- not paused (?). Parameters: the ids, the paused topics, the limit.
SELECT o.id, o.topic, o.uuid, o.payload, o.metadata, o.failures > 0, o.ordering_key
FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) j
STRAIGHT_JOIN {{.Outbox}} o FORCE INDEX (PRIMARY) ON o.id = j.id
WHERE o.failures = 0 AND o.quarantined_at IS NULL AND JSON_CONTAINS(?, JSON_QUOTE(o.topic)) = 0
LIMIT ?
FOR UPDATE SKIP LOCKED

-- name: Follow
-- Not locking: the ids of the next ? rows of the key ? after the row ?
-- (ClaimKeyed's follow_ids, for one head), oldest first: a range of the
-- ordering_key index, in its order (ORDER BY ordering_key, id made
-- MariaDB sort the key's every row after the head).
SELECT id FROM {{.Outbox}}
WHERE ordering_key = ? AND id > ?
ORDER BY id LIMIT ?

-- name: Blocked
-- Not locking: which of the batch's keyed rows (a JSON array of [id,
-- prev] pairs, prev the previous row of its key in the batch, 0 for none)
-- have an earlier row of their key outside the batch (another relay has
-- it, or it failed or is paused): ClaimKeyed's blocked.
SELECT o.id
FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$[0]', prev BIGINT PATH '$[1]')) j
STRAIGHT_JOIN {{.Outbox}} o FORCE INDEX (PRIMARY) ON o.id = j.id
WHERE o.ordering_key IS NOT NULL
  AND EXISTS (SELECT 1 FROM {{.Outbox}} e WHERE e.ordering_key = o.ordering_key AND e.id < o.id AND e.id > j.prev)

-- name: DeleteRelayed
-- The rows the publisher accepted (a JSON array of ids).
DELETE o FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) j
STRAIGHT_JOIN {{.Outbox}} o FORCE INDEX (PRIMARY) ON o.id = j.id

-- name: RecordFailure
-- The failure of one row of a batch (RecordFailures runs it per row, in
-- the batch's transaction): ? permanent (0/1: the message's own failure),
-- ? defect (0/1: unreadable, quarantined at once), ? the error's text, ?
-- and ? the backoff's base and longest wait in microseconds (the row waits
-- min(base * 2^failures, longest)), ? MaxAttempts (a permanent failure
-- counts towards it; there the row is quarantined), ? the row's id. The
-- assignments that read failures and attempts come before those that
-- change them: a single-table UPDATE assigns left to right, each seeing
-- the ones before (MariaDB's SIMULTANEOUS_ASSIGNMENT sees none), so in
-- this order both read the values before the UPDATE.
UPDATE {{.Outbox}} SET
  next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL CAST(LEAST(? * POW(2, LEAST(failures, 62)), ?) AS SIGNED) MICROSECOND,
  quarantined_at = CASE WHEN ? = 1 OR (? = 1 AND attempts + 1 >= ?) THEN UTC_TIMESTAMP(6) END,
  last_error = ?,
  attempts = attempts + ?,
  failures = failures + 1
WHERE id = ?

-- name: Recorded
-- The rows whose failures RecordFailure recorded (a JSON array of ids), as
-- they are now.
SELECT o.id, o.topic, o.uuid, o.attempts, o.failures, o.quarantined_at IS NOT NULL, COALESCE(o.last_error, '')
FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) j
STRAIGHT_JOIN {{.Outbox}} o FORCE INDEX (PRIMARY) ON o.id = j.id
ORDER BY o.id
