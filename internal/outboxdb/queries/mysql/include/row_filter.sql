-- Placeholder until the operator statements of MySQL are written.
-- name: RowFilter
TRUE
