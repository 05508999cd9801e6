-- Statements of the benchtable sections that run on either engine (router,
-- relay, retention), PostgreSQL's; queries/mysql/bench.sql has MariaDB's
-- under the same names. Identifiers arrive quoted ({{.Table}}, ...); values
-- travel as parameters.

-- name: CreateBusiness
CREATE TABLE IF NOT EXISTS {{.Business}} (id text PRIMARY KEY, payload bytea NOT NULL, created_at timestamptz NOT NULL DEFAULT now())

-- The router handler's one write: $1 the message UUID, $2 its payload.
-- name: BusinessInsert
INSERT INTO {{.Business}} (id, payload) VALUES ($1, $2)

-- name: Truncate
TRUNCATE {{.Table}}

-- name: Count
SELECT count(*) FROM {{.Table}}

-- name: Analyze
VACUUM ANALYZE {{.Table}}

-- Rows $2..$3 of an outbox backlog for topic $1, in the columns
-- outbox.Publisher writes (the rest default).
-- name: FillOutbox
INSERT INTO {{.Outbox}} (topic, uuid, payload, metadata)
SELECT $1, 'ob-' || g, convert_to('{"n":' || g || '}', 'UTF8'), '{"source":"bench"}'
FROM generate_series($2::bigint, $3::bigint) g

-- name: Now
SELECT now()

-- Records $1..$2 of the retention inbox, done, each with a 36-byte key (a
-- UUID's text: md5 of g), finished at $3 + (g - $1) * $4, in time order.
-- name: FillInboxDay
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, first_seen_at, processed_at{{if .Partitioned}}, partition_at{{end}})
SELECT 'bench', md5(g::text)::uuid::text, 'done', 1, t, t{{if .Partitioned}}, t{{end}}
FROM generate_series($1::bigint, $2::bigint) g, LATERAL (SELECT $3::timestamptz + (g - $1) * $4::interval AS t) x

-- The inbox's total size (heap, indexes, TOAST; every partition) and rows;
-- $1 the inbox's quoted name.
-- name: InboxSize
SELECT pg_total_relation_size($1::regclass) + coalesce((SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits WHERE inhparent = $1::regclass), 0),
(SELECT count(*) FROM {{.Inbox}})
