-- The backlog's statements, MySQL/MariaDB.

-- name: Pending
-- The backlog (package outbox's Pending). The count scans the table, which
-- holds only unrelayed rows. A key is blocked from its first failed row on
-- (failures > 0, which quarantined rows have too: the relay's own test of
-- a row it may take). Its blocked rows are counted from the ordering_key
-- index between that row and the key's end. Ages are the database's
-- (UTC_TIMESTAMP(6)), in seconds.
WITH failed AS (
  SELECT ordering_key, MIN(id) AS first FROM {{.Outbox}}
  WHERE ordering_key IS NOT NULL AND failures > 0 GROUP BY ordering_key
)
SELECT COUNT(*),
       MIN(CASE WHEN quarantined_at IS NULL THEN created_at END),
       TIMESTAMPDIFF(MICROSECOND, MIN(CASE WHEN quarantined_at IS NULL THEN created_at END), UTC_TIMESTAMP(6)) / 1e6,
       COUNT(CASE WHEN failures > 0 AND quarantined_at IS NULL THEN 1 END),
       COUNT(CASE WHEN quarantined_at IS NOT NULL THEN 1 END),
       (SELECT COUNT(*) FROM failed),
       (SELECT COUNT(*) FROM failed f JOIN {{.Outbox}} b ON b.ordering_key = f.ordering_key AND b.id > f.first WHERE b.failures = 0)
FROM {{.Outbox}}

-- name: RequeueFailed
-- Clears the failure record of every row that has one (each such row
-- changes, so rows affected counts them).
UPDATE {{.Outbox}} SET failures = 0, attempts = 0, next_attempt_at = NULL, quarantined_at = NULL, last_error = NULL
WHERE failures > 0 OR attempts > 0 OR quarantined_at IS NOT NULL OR next_attempt_at IS NOT NULL

-- name: PendingRows
-- The oldest rows (the CLI's 'outbox pending'), at most the last
-- parameter: every row when the state (the first three parameters, the
-- same value) is '', the quarantined ones when 'quarantined', the failing
-- ones when 'failing'. Ages are the database's (UTC_TIMESTAMP(6)). A row
-- is blocked as Pending counts it: it never failed, and waits behind a
-- failed row of its key.
SELECT id, topic, uuid, created_at,
       TIMESTAMPDIFF(MICROSECOND, created_at, UTC_TIMESTAMP(6)) / 1e6, LENGTH(payload),
       failures, attempts, next_attempt_at,
       COALESCE(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), next_attempt_at) / 1e6, 0),
       quarantined_at, COALESCE(last_error, ''), COALESCE(ordering_key, ''),
       ordering_key IS NOT NULL AND failures = 0 AND
         EXISTS (SELECT 1 FROM {{.Outbox}} e WHERE e.ordering_key = o.ordering_key AND e.failures > 0 AND e.id < o.id)
FROM {{.Outbox}} o
WHERE ? = ''
   OR (? = 'quarantined' AND quarantined_at IS NOT NULL)
   OR (? = 'failing' AND failures > 0 AND quarantined_at IS NULL)
ORDER BY id LIMIT ?
