-- name: A
SELECT 1
