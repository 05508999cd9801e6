-- The condition of a RowFilter (package outbox), on the row as o, written
-- into the statements of rows/*.sql (their RowFilter), which are rendered
-- once per state (.State: "quarantined", "failing" or "all"): the state's
-- condition is each time the predicate of a partial index of outbox_001
-- (failing, quarantined_*), which the planner proves from the statement
-- itself, in a generic plan too. The other fields are parameters, $1 to
-- $10 of each statement, a NULL one matching every row (a custom plan
-- folds it away): $1 ids (bigint[]), $2 topic, $3 uuid, $4 reason (a part
-- of the last error, ignoring case: no index holds it), $5 ordering key,
-- $6 quarantined since, $7 quarantined before, $8 metadata (a JSON object
-- the row's must contain), $9 the largest id, $10 as of: the quarantined
-- rows quarantined at or before it (failing rows hold no time of their
-- failure: $9 bounds them).
-- name: RowFilter
({{if eq .State "failing"}}o.failures > 0 AND o.quarantined_at IS NULL{{else if eq .State "all"}}(o.quarantined_at IS NOT NULL OR (o.failures > 0 AND o.quarantined_at IS NULL)){{else}}o.quarantined_at IS NOT NULL{{end}}
 AND ($1::bigint[] IS NULL OR o.id = ANY($1::bigint[]))
 AND ($2::text IS NULL OR o.topic = $2::text)
 AND ($3::text IS NULL OR o.uuid = $3::text)
 AND ($4::text IS NULL OR strpos(lower(o.last_error), lower($4::text)) > 0)
 AND ($5::text IS NULL OR o.ordering_key = $5::text)
 AND ($6::timestamptz IS NULL OR o.quarantined_at >= $6::timestamptz)
 AND ($7::timestamptz IS NULL OR o.quarantined_at < $7::timestamptz)
 AND ($8::jsonb IS NULL OR o.metadata @> $8::jsonb)
 AND ($9::bigint IS NULL OR o.id <= $9::bigint)
 AND ($10::timestamptz IS NULL OR {{if eq .State "failing"}}true{{else if eq .State "all"}}o.quarantined_at IS NULL OR o.quarantined_at <= $10::timestamptz{{else}}o.quarantined_at <= $10::timestamptz{{end}}))
