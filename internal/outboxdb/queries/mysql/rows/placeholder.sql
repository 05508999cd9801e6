-- Placeholder (wt-owrite) until the operator statements of MySQL are
-- written (rows/filtered.sql): New renders this directory. Delete it then.
-- name: RowsPlaceholder
SELECT 1
