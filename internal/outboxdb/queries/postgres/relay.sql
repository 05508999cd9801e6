-- The relay's statements (package outbox's relay.go, relay_batch.go,
-- relay_publish.go). Every statement is rendered once per table set:
-- {{.Outbox}} is the outbox table, quoted and schema-qualified.

-- name: Probe
-- Does the table have a row with an ordering key (the first entry of the
-- ordering_key index)? It also turns JIT compilation off for the batch's
-- transaction: the batch statements' estimates grow with the table (a
-- LIMIT computed in the statement reads as a tenth of it), and past
-- jit_above_cost PostgreSQL compiled them for every batch, 25 ms and more
-- each, for a few hundred rows.
SELECT set_config('jit', 'off', true),
       EXISTS (SELECT 1 FROM {{.Outbox}} WHERE ordering_key IS NOT NULL ORDER BY ordering_key, id LIMIT 1)

-- name: ClaimKeyed
-- A batch when the table has rows with an ordering key (Probe said so).
-- $1 the batch size, $2 the most rows that failed before it takes when
-- enough others wait, $3 the paused topics (text[]), $4 the window of the
-- oldest rows the heads of keys are looked for among (a few batches).
--
-- A batch ($1 rows) is the oldest rows that never failed, and the oldest
-- failed rows whose backoff is over, these at most $2 when there are
-- enough of the others: failing rows never crowd out the rows behind them,
-- and have the whole batch when nothing else waits. (A quarantined row has
-- failures > 0.) The topics paused ($3) wait: "not paused" is written
-- coalesce(topic <> ALL($3), true), a form the planner cannot estimate (a
-- default selectivity): "topic <> ALL($3)" on a table of one topic reads
-- as "no row", and the generic plan then scans and sorts the whole backlog
-- instead of walking the primary key.
--
-- due counts (and locks) only the failed rows this batch can take: those
-- another worker holds leave their room to fresh rows, or the batch would
-- come out short and read as "caught up". retry takes the same rows first
-- (the same order; this transaction's own locks do not skip).
--
-- Per-key order (ordering_key, see docs/ordering.md). A batch takes, among
-- the rows of a key, only the key's first row left in the table (its head:
-- no earlier row of the key exists, whatever its state), and then rows
-- that follow the heads it locked. A key whose head is failing or
-- quarantined (and not due), in a paused topic, or locked by another relay
-- (in flight) has no head this batch can take: none of its rows is taken,
-- and it takes no room. Writers of a key take its lock before they draw
-- ids (Insert), so a row visible here has every earlier row of its key
-- visible too. The head test asks for the key's first row (ORDER BY ...
-- LIMIT 1): in that form the planner takes the ordering_key index even for
-- a key that has most of the rows, where "NOT EXISTS an earlier row" was
-- planned as a scan of the table from its start, over every row the relay
-- had deleted.
--
-- scan: the heads are looked for among the oldest $4 rows that could have
-- one: not behind a failed row of their key (the small index of the failed
-- keyed rows answers it) nor behind a head in a paused topic. So the rows a
-- batch walks are bounded: the rows of keys whose head another relay has
-- in flight, and the deep backlog of a hot key, are passed over at most $4
-- at a time, and the rows that wait behind a blocked key are not in the
-- window at all, whatever their number. The window's ids (and the
-- followers') are given to the primary key as an array (= ANY(ARRAY(...))),
-- so that the plan visits those rows only: as a join, the planner walked
-- the whole table under the heads' filter; with the window's last id as a
-- bound instead, the workers that found every head in flight walked the
-- rest of the table.
--
-- The followers: the batch's room left after the heads, shared among the
-- keyed heads (at most ceil(room/keys) rows each), the rows of each key
-- right after its head, oldest first. A follower locked elsewhere, failed
-- or in a paused topic leaves a gap; the rows of its key after the gap are
-- flagged blocked (lag: the previous row of the key in the batch) and left
-- as they were.
WITH due AS (
  SELECT count(*) AS n FROM (
    SELECT 1 FROM {{.Outbox}} o
    WHERE failures > 0 AND quarantined_at IS NULL AND (next_attempt_at IS NULL OR next_attempt_at <= now())
      AND coalesce(topic <> ALL($3::text[]), true)
      AND (ordering_key IS NULL OR (SELECT e.id FROM {{.Outbox}} e WHERE e.ordering_key = o.ordering_key ORDER BY e.ordering_key, e.id LIMIT 1) = o.id)
    ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED) d
), scan AS (
  SELECT id FROM {{.Outbox}} o
  WHERE failures = 0 AND coalesce(topic <> ALL($3::text[]), true)
    AND (ordering_key IS NULL OR NOT EXISTS (SELECT 1 FROM {{.Outbox}} e WHERE e.ordering_key = o.ordering_key AND e.failures > 0 AND e.id < o.id))
    AND (cardinality($3::text[]) = 0 OR ordering_key IS NULL OR coalesce((SELECT e.topic <> ALL($3::text[]) FROM {{.Outbox}} e WHERE e.ordering_key = o.ordering_key ORDER BY e.ordering_key, e.id LIMIT 1), true))
  ORDER BY id LIMIT $4
), fresh AS (
  SELECT id, topic, uuid, payload, metadata::text, failures > 0 AS retry, ordering_key FROM {{.Outbox}} o
  WHERE id = ANY(ARRAY(SELECT id FROM scan)) AND failures = 0 AND coalesce(topic <> ALL($3::text[]), true)
    AND (ordering_key IS NULL OR (SELECT e.id FROM {{.Outbox}} e WHERE e.ordering_key = o.ordering_key ORDER BY e.ordering_key, e.id LIMIT 1) = o.id)
  ORDER BY id LIMIT $1 - (SELECT n FROM due) FOR UPDATE SKIP LOCKED
), retry AS (
  SELECT id, topic, uuid, payload, metadata::text, failures > 0 AS retry, ordering_key FROM {{.Outbox}} o
  WHERE failures > 0 AND quarantined_at IS NULL AND (next_attempt_at IS NULL OR next_attempt_at <= now())
    AND coalesce(topic <> ALL($3::text[]), true)
    AND (ordering_key IS NULL OR (SELECT e.id FROM {{.Outbox}} e WHERE e.ordering_key = o.ordering_key ORDER BY e.ordering_key, e.id LIMIT 1) = o.id)
  ORDER BY id LIMIT $1 - (SELECT count(*) FROM fresh) FOR UPDATE SKIP LOCKED
), heads AS (
  SELECT * FROM fresh UNION ALL SELECT * FROM retry
), room AS (
  SELECT greatest($1 - count(*), 0) AS n, count(ordering_key) AS keys FROM heads
), follow_ids AS (
  SELECT f.id FROM heads h CROSS JOIN LATERAL (
    SELECT e.id FROM {{.Outbox}} e WHERE e.ordering_key = h.ordering_key AND e.id > h.id ORDER BY e.id
    LIMIT (SELECT (n + keys - 1) / greatest(keys, 1) FROM room)
  ) f
  WHERE h.ordering_key IS NOT NULL
  ORDER BY f.id LIMIT (SELECT n FROM room)
), follow AS (
  SELECT id, topic, uuid, payload, metadata::text, failures > 0 AS retry, ordering_key FROM {{.Outbox}} o
  WHERE id = ANY(ARRAY(SELECT id FROM follow_ids)) AND failures = 0 AND coalesce(topic <> ALL($3::text[]), true)
  ORDER BY id FOR UPDATE SKIP LOCKED
), taken AS (
  SELECT *, coalesce(lag(id) OVER (PARTITION BY ordering_key ORDER BY id), 0) AS prev
  FROM (SELECT * FROM heads UNION ALL SELECT * FROM follow) u
)
SELECT id, topic, uuid, payload, metadata, retry, ordering_key,
  ordering_key IS NOT NULL AND EXISTS (SELECT 1 FROM {{.Outbox}} e WHERE e.ordering_key = t.ordering_key AND e.id < t.id AND e.id > t.prev) AS blocked
FROM taken t ORDER BY id

-- name: ClaimPlain
-- A batch when the table has no row with an ordering key (Probe said so):
-- the oldest rows by the primary key, as before keys existed, at the same
-- cost. $1, $2 and $3 are ClaimKeyed's; there is no window. A row with a
-- key committed after the probe may still come in it: the last step, the
-- same as ClaimKeyed's, flags it blocked when an earlier row of its key is
-- outside the batch (another relay has it), so the order never rests on
-- the probe's timing.
--
-- Two statements, not one with the variant as a parameter: each is planned
-- (and, prepared, cached) for its own shape. One statement would carry the
-- keyed CTEs (the window, the heads, the followers) in every plan of a
-- table without keys, with the costs of both arms mixed in its generic
-- plan, and a change to one variant could move the plan of the other.
-- They differ in fresh and retry only (no window, no head test); due,
-- taken and the final SELECT are written the same in both.
WITH due AS (
  SELECT count(*) AS n FROM (
    SELECT 1 FROM {{.Outbox}}
    WHERE failures > 0 AND quarantined_at IS NULL AND (next_attempt_at IS NULL OR next_attempt_at <= now())
      AND coalesce(topic <> ALL($3::text[]), true)
    ORDER BY id LIMIT $2 FOR UPDATE SKIP LOCKED) d
), fresh AS (
  SELECT id, topic, uuid, payload, metadata::text, failures > 0 AS retry, ordering_key FROM {{.Outbox}}
  WHERE failures = 0 AND coalesce(topic <> ALL($3::text[]), true)
  ORDER BY id LIMIT $1 - (SELECT n FROM due) FOR UPDATE SKIP LOCKED
), retry AS (
  SELECT id, topic, uuid, payload, metadata::text, failures > 0 AS retry, ordering_key FROM {{.Outbox}}
  WHERE failures > 0 AND quarantined_at IS NULL AND (next_attempt_at IS NULL OR next_attempt_at <= now())
    AND coalesce(topic <> ALL($3::text[]), true)
  ORDER BY id LIMIT $1 - (SELECT count(*) FROM fresh) FOR UPDATE SKIP LOCKED
), taken AS (
  SELECT *, coalesce(lag(id) OVER (PARTITION BY ordering_key ORDER BY id), 0) AS prev
  FROM (SELECT * FROM fresh UNION ALL SELECT * FROM retry) u
)
SELECT id, topic, uuid, payload, metadata, retry, ordering_key,
  ordering_key IS NOT NULL AND EXISTS (SELECT 1 FROM {{.Outbox}} e WHERE e.ordering_key = t.ordering_key AND e.id < t.id AND e.id > t.prev) AS blocked
FROM taken t ORDER BY id

-- name: DeleteRelayed
-- The rows the publisher accepted ($1, bigint[]).
DELETE FROM {{.Outbox}} WHERE id = ANY($1::bigint[])

-- name: RecordFailures
-- The failures of a batch, one row each: $1 ids, $2 permanent (the
-- message's own failure), $3 defect (unreadable: quarantined at once), $4
-- the error's text. Each failed row waits out its backoff, min($5 *
-- 2^failures, $6) microseconds; a permanent failure counts towards $7
-- (MaxAttempts), where the row is quarantined.
UPDATE {{.Outbox}} o SET
  failures = o.failures + 1,
  attempts = o.attempts + f.permanent::int,
  next_attempt_at = clock_timestamp() + least($5::float8 * power(2::float8, least(o.failures, 62)), $6::float8) * interval '1 microsecond',
  last_error = f.err,
  quarantined_at = CASE WHEN f.defect OR (f.permanent AND o.attempts + 1 >= $7::int) THEN clock_timestamp() END
FROM unnest($1::bigint[], $2::boolean[], $3::boolean[], $4::text[]) AS f(id, permanent, defect, err)
WHERE o.id = f.id
RETURNING o.id, o.topic, o.uuid, o.attempts, o.failures, o.quarantined_at IS NOT NULL, coalesce(o.last_error, '')

-- name: IDSequence
-- The sequence behind the outbox table's ($1, its quoted name as text) id
-- column, and its cache, from the table itself, whatever created it: the
-- sequence the column owns (bigserial, or an identity column), else the one
-- its default draws from (a sequence created apart, as some schema tools
-- write it). No row when the table does not exist; NULLs when the column
-- draws from no sequence.
SELECT s.seqcache, s.seqrelid::regclass::text
FROM (SELECT to_regclass($1::text) AS t) t
LEFT JOIN LATERAL (SELECT coalesce(pg_get_serial_sequence($1::text, 'id')::regclass,
    (SELECT d.refobjid::regclass FROM pg_attrdef a
     JOIN pg_depend d ON d.classid = 'pg_attrdef'::regclass AND d.objid = a.oid AND d.refclassid = 'pg_class'::regclass
     JOIN pg_class c ON c.oid = d.refobjid AND c.relkind = 'S'
     WHERE a.adrelid = t.t AND a.adnum = (SELECT attnum FROM pg_attribute WHERE attrelid = t.t AND attname = 'id' AND NOT attisdropped)
     LIMIT 1)) AS seq) q ON true
LEFT JOIN pg_sequence s ON s.seqrelid = q.seq
WHERE t.t IS NOT NULL
