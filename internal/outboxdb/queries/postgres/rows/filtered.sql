-- The operator's statements on the rows a RowFilter selects (package
-- outbox's Store). Each is rendered once per state of the filter (.State,
-- see include/row_filter.sql): {{.RowFilter}} is the filter's condition on
-- the row as o, with its parameters $1 to $10; a statement's own
-- parameters follow.

-- name: FindRows
-- A page of the rows the filter selects with ids above $11, at most $12,
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
WHERE {{.RowFilter}} AND o.id > $11::bigint
ORDER BY o.id LIMIT $12::int

-- name: CountRows
-- The number of rows the filter selects, at most $11 (NULL: no bound), and
-- the largest id among them (0 when none).
SELECT count(*), coalesce(max(id), 0)
FROM (SELECT o.id FROM {{.Outbox}} o WHERE {{.RowFilter}} LIMIT $11::int) c

-- name: BoundedScanCount
-- The bounded read's check: how many rows the filter's indexed conditions
-- select (the caller leaves $4, the reason, NULL), at most $11. set_config
-- runs once this statement is planned: the check reads the indexes as the
-- read after it will, through their bitmaps.
SELECT count(*), set_config('enable_indexscan', 'off', true)
FROM (SELECT 1 FROM {{.Outbox}} o WHERE {{.RowFilter}} LIMIT $11::int) c

-- name: RequeueMatching
-- One batch of RequeueMatching: the rows the filter selects with ids above
-- $11, at most $12 in id order, that no other transaction holds; their
-- failure records cleared, and the relays woken when a row changed. It
-- returns the rows changed, the rows picked and the largest id picked (the
-- next batch's $11).
WITH picked AS (
  SELECT o.id FROM {{.Outbox}} o WHERE {{.RowFilter}} AND o.id > $11::bigint
  ORDER BY o.id LIMIT $12::int FOR UPDATE SKIP LOCKED
), acted AS (
  UPDATE {{.Outbox}} o SET failures = 0, attempts = 0, next_attempt_at = NULL, quarantined_at = NULL, last_error = NULL
  FROM picked p WHERE o.id = p.id RETURNING o.id
)
SELECT (SELECT count(*) FROM acted), (SELECT count(*) FROM picked), (SELECT coalesce(max(id), 0) FROM picked),
  (CASE WHEN (SELECT count(*) FROM acted) > 0 THEN pg_notify({{.Channel}}, '') END) IS NULL

-- name: DiscardMatching
-- One batch of DiscardMatching: RequeueMatching's, deleting the rows.
WITH picked AS (
  SELECT o.id FROM {{.Outbox}} o WHERE {{.RowFilter}} AND o.id > $11::bigint
  ORDER BY o.id LIMIT $12::int FOR UPDATE SKIP LOCKED
), acted AS (
  DELETE FROM {{.Outbox}} o USING picked p WHERE o.id = p.id RETURNING o.id
)
SELECT (SELECT count(*) FROM acted), (SELECT count(*) FROM picked), (SELECT coalesce(max(id), 0) FROM picked), true
