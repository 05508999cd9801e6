-- sqlschema's bookkeeping (migrate.go, check.go, status.go): the
-- migrations table, the lock that serialises Migrate, the checks of what
-- exists. The migrations themselves are migrations/*.up.sql.
-- {{.Schema}} and {{.Migrations}} are quoted; {{.MigrateLockKey}} is a
-- fixed number ("eo-migr" in ASCII).

-- name: CreateSchema
CREATE SCHEMA IF NOT EXISTS {{.Schema}};

-- name: MigrateLock
SELECT pg_advisory_xact_lock({{.MigrateLockKey}})

-- name: CreateMigrationsTable
CREATE SCHEMA IF NOT EXISTS {{.Schema}};
CREATE TABLE IF NOT EXISTS {{.Migrations}} (
    target     text        NOT NULL,
    version    integer     NOT NULL,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (target, version)
)

-- name: RecordMigration
INSERT INTO {{.Migrations}} (target, version, name) VALUES ($1, $2, $3)

-- name: AppliedMigrations
SELECT target, version, name, applied_at FROM {{.Migrations}}

-- name: ClaimFunctionsMissing
SELECT to_regprocedure($1) IS NULL OR to_regprocedure($2) IS NULL OR to_regprocedure($3) IS NULL

-- name: TableExists
SELECT to_regclass($1) IS NOT NULL

-- name: TableKind
SELECT relkind::text FROM pg_class WHERE oid = to_regclass($1)
