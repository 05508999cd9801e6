-- The backlog's statements.

-- name: Pending
-- The backlog (package outbox's Pending). The count scans the table, which
-- holds only unrelayed rows. A key is blocked from its first failed row on
-- (failures > 0, which quarantined rows have too: the relay's own test of
-- a row it may take). Its blocked rows are counted from the ordering_key
-- index between that row and the key's end, not by a test of every row of
-- the scan: with no blocked key the statement costs what the scan does.
WITH failed AS (
  SELECT ordering_key, min(id) AS first FROM {{.Outbox}}
  WHERE ordering_key IS NOT NULL AND failures > 0 GROUP BY ordering_key
)
SELECT count(*),
       min(created_at) FILTER (WHERE quarantined_at IS NULL),
       extract(epoch FROM now() - min(created_at) FILTER (WHERE quarantined_at IS NULL))::float8,
       count(*) FILTER (WHERE failures > 0 AND quarantined_at IS NULL),
       count(*) FILTER (WHERE quarantined_at IS NOT NULL),
       (SELECT count(*) FROM failed),
       (SELECT count(*) FROM failed f JOIN {{.Outbox}} b ON b.ordering_key = f.ordering_key AND b.id > f.first WHERE b.failures = 0)
FROM {{.Outbox}}

-- name: RequeueFailed
-- Clears the failure record of every row that has one.
UPDATE {{.Outbox}} SET failures = 0, attempts = 0, next_attempt_at = NULL, quarantined_at = NULL, last_error = NULL
WHERE failures > 0 OR attempts > 0 OR quarantined_at IS NOT NULL OR next_attempt_at IS NOT NULL

-- name: PendingRows
-- The oldest $2 rows (the CLI's 'outbox pending'): every row when $1 is
-- '', the quarantined ones when 'quarantined', the failing ones when
-- 'failing'. Ages are the database's (now()). A row is blocked as Pending
-- counts it: it never failed, and waits behind a failed row of its key.
SELECT id, topic, uuid, created_at,
       extract(epoch FROM now() - created_at)::float8, octet_length(payload)::bigint,
       failures, attempts, next_attempt_at,
       coalesce(extract(epoch FROM next_attempt_at - now())::float8, 0),
       quarantined_at, coalesce(last_error, ''), coalesce(ordering_key, ''),
       ordering_key IS NOT NULL AND failures = 0 AND
         EXISTS (SELECT 1 FROM {{.Outbox}} e WHERE e.ordering_key = o.ordering_key AND e.failures > 0 AND e.id < o.id)
FROM {{.Outbox}} o
WHERE $1::text = ''
   OR ($1::text = 'quarantined' AND quarantined_at IS NOT NULL)
   OR ($1::text = 'failing' AND failures > 0 AND quarantined_at IS NULL)
ORDER BY id LIMIT $2::int
