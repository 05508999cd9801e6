-- Statements of mysql_test.go. {{.Table}} is quoted by the caller.

-- name: CurrentDatabase
SELECT DATABASE()

-- name: CreateTable
CREATE TABLE {{.Table}} (id INT PRIMARY KEY)

-- name: Insert
INSERT INTO {{.Table}} (id) VALUES (?)

-- name: CountRows
SELECT COUNT(*) FROM {{.Table}}

-- name: TableExists
SELECT COUNT(*) FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?

-- name: DatabaseExists
SELECT COUNT(*) FROM information_schema.schemata WHERE schema_name = ?

-- name: Now
SELECT UTC_TIMESTAMP(6)
