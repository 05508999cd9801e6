-- Statements of the benchtable sections that run on either engine (router,
-- relay, retention), MariaDB's (go-sql-driver/mysql, `?` placeholders);
-- queries/postgres/bench.sql has PostgreSQL's under the same names. Bulk
-- rows come from MariaDB's SEQUENCE engine (seq_<from>_to_<to>), in one
-- multi-row INSERT ... SELECT per chunk.

-- name: CreateBusiness
CREATE TABLE IF NOT EXISTS {{.Business}} (
    id         VARBINARY(255) NOT NULL PRIMARY KEY,
    payload    LONGBLOB       NOT NULL,
    created_at DATETIME(6)    NOT NULL DEFAULT (UTC_TIMESTAMP(6))
) ENGINE = InnoDB

-- name: BusinessInsert
INSERT INTO {{.Business}} (id, payload) VALUES (?, ?)

-- name: Truncate
TRUNCATE TABLE {{.Table}}

-- name: Count
SELECT COUNT(*) FROM {{.Table}}

-- name: Analyze
ANALYZE TABLE {{.Table}}

-- Rows From..To of an outbox backlog for topic ?, as the PostgreSQL fill
-- writes them; created_at has no default on MySQL. The ids (AUTO_INCREMENT)
-- follow the sequence.
-- name: FillOutbox
INSERT INTO {{.Outbox}} (topic, uuid, payload, metadata, created_at)
SELECT ?, CONCAT('ob-', seq), CONCAT('{"n":', seq, '}'), '{"source":"bench"}', UTC_TIMESTAMP(6)
FROM seq_{{.From}}_to_{{.To}}

-- name: Now
SELECT UTC_TIMESTAMP(6)

-- Records From..To of the retention inbox, as PostgreSQL's FillInboxDay
-- writes them (the same keys: md5 of g as a UUID's text), finished at
-- ? (the day's start) + (g - ?) * ? µs. Inserted in key order: one pass
-- over the primary key's pages per chunk instead of a random page per row.
-- name: FillInboxDay
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, first_seen_at, processed_at)
SELECT 'bench', k, 'done', 1, t, t
FROM (
    SELECT CONCAT_WS('-', SUBSTR(h, 1, 8), SUBSTR(h, 9, 4), SUBSTR(h, 13, 4), SUBSTR(h, 17, 4), SUBSTR(h, 21, 12)) AS k,
           CAST(? AS DATETIME(6)) + INTERVAL ((seq - ?) * ?) MICROSECOND AS t
    FROM (SELECT seq, MD5(seq) AS h FROM seq_{{.From}}_to_{{.To}}) s
) x
ORDER BY k

-- The inbox's size (InnoDB's estimate: data and indexes, after ANALYZE
-- TABLE) and rows; ? ? the database and the table.
-- name: InboxSize
SELECT (SELECT data_length + index_length FROM information_schema.tables WHERE table_schema = ? AND table_name = ?),
(SELECT COUNT(*) FROM {{.Inbox}})

-- name: DropDatabase
DROP DATABASE IF EXISTS {{.Database}}
