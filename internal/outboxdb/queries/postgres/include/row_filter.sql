-- The condition of a RowFilter (package outbox), on the row as o, written
-- into the statements of rows.sql (their RowFilter): its parameters
-- are $1 to $11 of each, a NULL one matching every row. $1 is the state
-- ('quarantined', 'failing' or 'all'); each arm is the predicate of a
-- partial index of outbox_001 (failing, quarantined_*), which the planner
-- proves from the parameters' values (a custom plan folds the arms that do
-- not apply away). $2 ids (bigint[]), $3 topic, $4 uuid, $5 reason (a part
-- of the last error, ignoring case: no index holds it), $6 ordering key, $7
-- quarantined since, $8 quarantined before, $9 metadata (a JSON object the
-- row's must contain), $10 the largest id, $11 as of: the quarantined rows
-- quarantined at or before it (failing rows hold no time of their failure:
-- $10 bounds them).
-- name: RowFilter
((($1::text = 'quarantined' AND o.quarantined_at IS NOT NULL)
  OR ($1::text = 'failing' AND o.failures > 0 AND o.quarantined_at IS NULL)
  OR ($1::text = 'all' AND (o.quarantined_at IS NOT NULL OR (o.failures > 0 AND o.quarantined_at IS NULL))))
 AND ($2::bigint[] IS NULL OR o.id = ANY($2::bigint[]))
 AND ($3::text IS NULL OR o.topic = $3::text)
 AND ($4::text IS NULL OR o.uuid = $4::text)
 AND ($5::text IS NULL OR strpos(lower(o.last_error), lower($5::text)) > 0)
 AND ($6::text IS NULL OR o.ordering_key = $6::text)
 AND ($7::timestamptz IS NULL OR o.quarantined_at >= $7::timestamptz)
 AND ($8::timestamptz IS NULL OR o.quarantined_at < $8::timestamptz)
 AND ($9::jsonb IS NULL OR o.metadata @> $9::jsonb)
 AND ($10::bigint IS NULL OR o.id <= $10::bigint)
 AND ($11::timestamptz IS NULL OR $1::text = 'failing' OR o.quarantined_at <= $11::timestamptz
      OR ($1::text = 'all' AND o.quarantined_at IS NULL)))
