-- The condition of a RowFilter (package outbox), on the row as o, written
-- into the statements of rows/*.sql (their RowFilter), which are rendered
-- once per state (.State: "quarantined", "failing" or "all"): the state's
-- condition is written into the statement, so the optimizer sees it (the
-- failing and quarantined_* indexes of outbox_001 serve it). The other
-- fields are parameters, a NULL one matching every row. MySQL's `?` is
-- positional and cannot be named twice: each field is passed twice, in
-- this order (outboxdb.Filter.args), once for its NULL test and once for
-- its condition: ids (a JSON array of integers, read by JSON_TABLE), topic,
-- uuid, reason (a part of the last error, ignoring case: no index holds
-- it), ordering key, quarantined since, quarantined before, metadata (a
-- JSON object the row's must contain), the largest id, as of: the
-- quarantined rows quarantined at or before it (failing rows hold no time
-- of their failure: the largest id bounds them; the failing state takes
-- its two parameters and selects every row with them). Times are
-- DATETIME(6) in UTC.
-- name: RowFilter
({{if eq .State "failing"}}o.failures > 0 AND o.quarantined_at IS NULL{{else if eq .State "all"}}(o.quarantined_at IS NOT NULL OR (o.failures > 0 AND o.quarantined_at IS NULL)){{else}}o.quarantined_at IS NOT NULL{{end}}
 AND (? IS NULL OR o.id IN (SELECT j.id FROM JSON_TABLE(?, '$[*]' COLUMNS (id BIGINT PATH '$')) j))
 AND (? IS NULL OR o.topic = ?)
 AND (? IS NULL OR o.uuid = ?)
 AND (? IS NULL OR LOCATE(LOWER(?), LOWER(o.last_error)) > 0)
 AND (? IS NULL OR o.ordering_key = ?)
 AND (? IS NULL OR o.quarantined_at >= ?)
 AND (? IS NULL OR o.quarantined_at < ?)
 AND (? IS NULL OR JSON_CONTAINS(o.metadata, ?))
 AND (? IS NULL OR o.id <= ?)
 AND (? IS NULL OR {{if eq .State "failing"}}? IS NULL OR TRUE{{else if eq .State "all"}}o.quarantined_at IS NULL OR o.quarantined_at <= ?{{else}}o.quarantined_at <= ?{{end}}))
