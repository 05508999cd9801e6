-- sqlschema's bookkeeping on MySQL/MariaDB (migrate.go, check.go,
-- status.go). DDL commits implicitly in MySQL, so Migrate runs on one
-- connection, serialised by a session-level named lock (GET_LOCK) that it
-- releases when done; the migrations table records each migration right
-- after it is applied. {{.Schema}} and {{.Migrations}} are quoted;
-- {{.MigrateLockName}} is a fixed name.

-- name: CreateSchema
CREATE DATABASE IF NOT EXISTS {{.Schema}};

-- name: MigrateLock
SELECT GET_LOCK('{{.MigrateLockName}}', 60)

-- name: MigrateUnlock
SELECT RELEASE_LOCK('{{.MigrateLockName}}')

-- name: CreateMigrationsTable
CREATE TABLE IF NOT EXISTS {{.Migrations}} (
    target     VARCHAR(255) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    version    INT          NOT NULL,
    name       VARCHAR(255) NOT NULL,
    applied_at DATETIME(6)  NOT NULL,
    PRIMARY KEY (target, version)
) ENGINE = InnoDB

-- name: RecordMigration
INSERT INTO {{.Migrations}} (target, version, name, applied_at) VALUES (?, ?, ?, UTC_TIMESTAMP(6))

-- name: AppliedMigrations
SELECT target, version, name, applied_at FROM {{.Migrations}}

-- name: TableExists
-- $1 the schema ('' for the connection's database), $2 the table.
SELECT count(*) > 0 FROM information_schema.tables
WHERE table_schema = coalesce(nullif(?, ''), database()) AND table_name = ?

-- name: TableKind
-- The table's engine ('r' for InnoDB, as PostgreSQL's plain table; the
-- engine's name otherwise, refused by Check: MyISAM has no transactions).
SELECT CASE WHEN engine = 'InnoDB' THEN 'r' ELSE engine END FROM information_schema.tables
WHERE table_schema = coalesce(nullif(?, ''), database()) AND table_name = ?

-- name: ServerVersion
-- version() ('10.11.19-MariaDB-...', '8.0.36') and a DATETIME(6) value, to
-- see that the DSN has parseTime=true (it scans into a time.Time).
SELECT version(), UTC_TIMESTAMP(6)

-- name: ProbeCreate
-- The found-rows probe (CheckConn): with go-sql-driver's clientFoundRows=true
-- an INSERT ... ON DUPLICATE KEY UPDATE that changes nothing reports one
-- affected row, as an insert does, and the claims tell an existing record
-- from a new one by that count. A temporary table of the session.
CREATE TEMPORARY TABLE watermill_exactlyonce_probe (id INT PRIMARY KEY)

-- name: ProbeUpsert
INSERT INTO watermill_exactlyonce_probe (id) VALUES (1) ON DUPLICATE KEY UPDATE id = id

-- name: ProbeDrop
DROP TEMPORARY TABLE IF EXISTS watermill_exactlyonce_probe
