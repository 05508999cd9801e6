-- The writers' statements (internal/outboxwrite).

-- name: Insert
-- The rows of one Publish call for topic $1: $2 the messages' UUIDs, $3
-- their payloads, $4 their metadata (JSON objects), $5 their ordering keys
-- ('' for none), in the order of the call. Before drawing the rows' ids it
-- takes the transaction-level advisory lock ($6, k) of each k of $7, the
-- sorted, distinct hashes of the call's ordering keys (empty: none), in
-- that order: the locks are a one-time filter of the plan (an InitPlan),
-- evaluated before the first row, and the id default is computed with
-- each row after it, in the call's order (WITH ORDINALITY). One statement,
-- so that a Publish outside a transaction (its own autocommit transaction)
-- holds the locks until its rows are committed, like one inside.
INSERT INTO {{.Outbox}} (topic, uuid, payload, metadata, ordering_key)
SELECT $1::text, m.uuid, m.payload, m.metadata::jsonb, nullif(m.ordering_key, '')
FROM unnest($2::text[], $3::bytea[], $4::text[], $5::text[]) WITH ORDINALITY AS m(uuid, payload, metadata, ordering_key, n)
WHERE (SELECT count(pg_advisory_xact_lock($6::int4, k)) FROM unnest($7::int4[]) AS k) >= 0
ORDER BY m.n

-- name: InsertNotify
-- Insert, and the table's NOTIFY in the same statement (no extra round
-- trip): a data-modifying WITH runs to completion whether or not the outer
-- query reads it. The parameters are Insert's.
WITH ins AS (
  INSERT INTO {{.Outbox}} (topic, uuid, payload, metadata, ordering_key)
  SELECT $1::text, m.uuid, m.payload, m.metadata::jsonb, nullif(m.ordering_key, '')
  FROM unnest($2::text[], $3::bytea[], $4::text[], $5::text[]) WITH ORDINALITY AS m(uuid, payload, metadata, ordering_key, n)
  WHERE (SELECT count(pg_advisory_xact_lock($6::int4, k)) FROM unnest($7::int4[]) AS k) >= 0
  ORDER BY m.n
)
SELECT pg_notify({{.Channel}}, '')

-- name: Notify
-- The table's NOTIFY alone (delivered when the transaction commits).
SELECT pg_notify({{.Channel}}, '')
