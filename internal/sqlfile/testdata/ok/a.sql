-- The inbox.
-- name: A
SELECT 1 FROM {{.T}}
  WHERE x = $1;

-- name: B
DELETE FROM {{.T}}
