-- name: A
SELECT 2
