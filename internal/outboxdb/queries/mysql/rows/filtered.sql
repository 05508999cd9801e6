-- The operator's statements on the rows a RowFilter selects (package
-- outbox's Store), MySQL/MariaDB. Each is rendered once per state of the
-- filter (.State, see include/row_filter.sql): {{.RowFilter}} is the
-- filter's condition on the row as o, with its 20 parameters (each field
-- twice); a statement's own parameters follow.

-- name: FindRows
-- A page of the rows the filter selects with ids above the first own
-- parameter, at most the second, in id order, without their payloads
-- (NULL; LENGTH is the payload's size in bytes). The rows waiting behind a
-- failed row with a key are counted on the ordering_key index (a range of
-- it after the row's id).
SELECT o.id, o.topic, o.uuid, NULL, LENGTH(o.payload), o.metadata, o.created_at, o.quarantined_at,
  o.failures, o.attempts, o.next_attempt_at, COALESCE(o.last_error, ''), COALESCE(o.ordering_key, ''),
  CASE WHEN o.ordering_key IS NOT NULL AND o.failures > 0
    THEN (SELECT COUNT(*) FROM {{.Outbox}} w WHERE w.ordering_key = o.ordering_key AND w.id > o.id) ELSE 0 END
FROM {{.Outbox}} o
WHERE {{.RowFilter}} AND o.id > ?
ORDER BY o.id LIMIT ?

-- name: CountRows
-- The number of rows the filter selects, at most the own parameter (MySQL
-- has no LIMIT NULL: the caller passes the largest BIGINT for no bound),
-- and the largest id among them (0 when none).
SELECT COUNT(*), COALESCE(MAX(c.id), 0)
FROM (SELECT o.id FROM {{.Outbox}} o WHERE {{.RowFilter}} LIMIT ?) c

-- name: BoundedScanCount
-- The bounded read's check: how many rows the filter's indexed conditions
-- select (the caller leaves the reason NULL), at most the own parameter.
-- MySQL has no planner settings to set with it (see outboxdb.BoundedScan).
SELECT COUNT(*) FROM (SELECT 1 FROM {{.Outbox}} o WHERE {{.RowFilter}} LIMIT ?) c

-- name: PickMatching
-- The first step of a batch of RequeueMatching or DiscardMatching, in the
-- batch's transaction: the rows the filter selects with ids above the
-- first own parameter, at most the second in id order, that no other
-- transaction holds, locked (MySQL cannot lock and change in one
-- statement: RequeuePicked or DiscardPicked follows, on these ids).
SELECT o.id FROM {{.Outbox}} o WHERE {{.RowFilter}} AND o.id > ?
ORDER BY o.id LIMIT ? FOR UPDATE SKIP LOCKED
