-- The operator's statements on outbox rows (package outbox's Store).
-- {{.RowFilter}} is the condition of include/row_filter.sql, on the row as
-- o, with its parameters $1 to $11; a statement's own parameters follow.

-- name: FindRows
-- A page of the rows the filter selects with ids above $12, at most $13,
-- in id order, without their payloads (NULL; octet_length is the payload's
-- size, answered from the stored value's header: a large payload is stored
-- out of line, TOAST, and is not read for it). The rows waiting behind a
-- failed row with a key are counted on the ordering_key index (a range of
-- it after the row's id).
SELECT o.id, o.topic, o.uuid, NULL::bytea, octet_length(o.payload), o.metadata::text, o.created_at, o.quarantined_at,
  o.failures, o.attempts, o.next_attempt_at, coalesce(o.last_error, ''), coalesce(o.ordering_key, ''),
  CASE WHEN o.ordering_key IS NOT NULL AND o.failures > 0
    THEN (SELECT count(*) FROM {{.Outbox}} w WHERE w.ordering_key = o.ordering_key AND w.id > o.id) ELSE 0 END
FROM {{.Outbox}} o
WHERE {{.RowFilter}} AND o.id > $12::bigint
ORDER BY o.id LIMIT $13::int

-- name: GetRow
-- The row $1 with its payload: all of it when $2 is NULL, else its first
-- $2 bytes (substring reads that slice of the stored value only). The
-- columns are FindRows'.
SELECT o.id, o.topic, o.uuid,
  CASE WHEN $2::int IS NULL THEN o.payload ELSE substring(o.payload FROM 1 FOR $2::int) END,
  octet_length(o.payload), o.metadata::text, o.created_at, o.quarantined_at,
  o.failures, o.attempts, o.next_attempt_at, coalesce(o.last_error, ''), coalesce(o.ordering_key, ''),
  CASE WHEN o.ordering_key IS NOT NULL AND o.failures > 0
    THEN (SELECT count(*) FROM {{.Outbox}} w WHERE w.ordering_key = o.ordering_key AND w.id > o.id) ELSE 0 END
FROM {{.Outbox}} o
WHERE o.id = $1::bigint

-- name: CountRows
-- The number of rows the filter selects, at most $12 (NULL: no bound), and
-- the largest id among them (0 when none).
SELECT count(*), coalesce(max(id), 0)
FROM (SELECT o.id FROM {{.Outbox}} o WHERE {{.RowFilter}} LIMIT $12::int) c

-- name: Now
-- The database's time.
SELECT now()

-- name: BoundedScanSettings
-- The first statement of a bounded read (package outbox's boundedRead),
-- in its read-only transaction: no sequential scan, no JIT.
SELECT set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)

-- name: BoundedScanCount
-- The bounded read's check: how many rows the filter's indexed conditions
-- select (the caller leaves $5, the reason, NULL), at most $12. set_config
-- runs once this statement is planned: the check reads the indexes as the
-- read after it will, through their bitmaps.
SELECT count(*), set_config('enable_indexscan', 'off', true)
FROM (SELECT 1 FROM {{.Outbox}} o WHERE {{.RowFilter}} LIMIT $12::int) c

-- name: LockRow
-- Row $1's failure record, locked for the operator's action on it.
SELECT quarantined_at, failures, attempts FROM {{.Outbox}} WHERE id = $1::bigint FOR UPDATE

-- name: RequeueRow
-- Clears the failure record of the quarantined row $1 and wakes the
-- table's relays (a NOTIFY, delivered at commit). It returns the number of
-- rows changed.
WITH acted AS (
  UPDATE {{.Outbox}} SET failures = 0, attempts = 0, next_attempt_at = NULL, quarantined_at = NULL, last_error = NULL
  WHERE id = $1::bigint AND quarantined_at IS NOT NULL RETURNING id
)
SELECT n, (CASE WHEN n > 0 THEN pg_notify({{.Channel}}, '') END) IS NULL
FROM (SELECT count(*) AS n FROM acted) c

-- name: DiscardRow
-- Deletes the quarantined row $1. It returns the number of rows deleted.
WITH acted AS (
  DELETE FROM {{.Outbox}} WHERE id = $1::bigint AND quarantined_at IS NOT NULL RETURNING id
)
SELECT n, true FROM (SELECT count(*) AS n FROM acted) c

-- name: RequeueMatching
-- One batch of RequeueMatching: the rows the filter selects with ids above
-- $12, at most $13 in id order, that no other transaction holds; their
-- failure records cleared, and the relays woken when a row changed. It
-- returns the rows changed, the rows picked and the largest id picked (the
-- next batch's $12).
WITH picked AS (
  SELECT o.id FROM {{.Outbox}} o WHERE {{.RowFilter}} AND o.id > $12::bigint
  ORDER BY o.id LIMIT $13::int FOR UPDATE SKIP LOCKED
), acted AS (
  UPDATE {{.Outbox}} o SET failures = 0, attempts = 0, next_attempt_at = NULL, quarantined_at = NULL, last_error = NULL
  FROM picked p WHERE o.id = p.id RETURNING o.id
)
SELECT (SELECT count(*) FROM acted), (SELECT count(*) FROM picked), (SELECT coalesce(max(id), 0) FROM picked),
  (CASE WHEN (SELECT count(*) FROM acted) > 0 THEN pg_notify({{.Channel}}, '') END) IS NULL

-- name: DiscardMatching
-- One batch of DiscardMatching: RequeueMatching's, deleting the rows.
WITH picked AS (
  SELECT o.id FROM {{.Outbox}} o WHERE {{.RowFilter}} AND o.id > $12::bigint
  ORDER BY o.id LIMIT $13::int FOR UPDATE SKIP LOCKED
), acted AS (
  DELETE FROM {{.Outbox}} o USING picked p WHERE o.id = p.id RETURNING o.id
)
SELECT (SELECT count(*) FROM acted), (SELECT count(*) FROM picked), (SELECT coalesce(max(id), 0) FROM picked), true
