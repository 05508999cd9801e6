-- name: C
SELECT 2
