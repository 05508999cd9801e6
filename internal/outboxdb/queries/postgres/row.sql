-- The operator's statements on one row, and the bounded read's settings
-- (package outbox's Store).

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

-- name: Now
-- The database's time.
SELECT now()

-- name: BoundedScanSettings
-- The first statement of a bounded read (package outbox's boundedRead),
-- in its read-only transaction: no sequential scan, no JIT.
SELECT set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)

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

