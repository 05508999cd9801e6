-- Statements of internal/testenv on MySQL/MariaDB: a database of a test's
-- own. {{.Database}} is quoted by the caller (backticks).

-- name: CreateDatabase
CREATE DATABASE {{.Database}} CHARACTER SET utf8mb4

-- name: DropDatabase
DROP DATABASE IF EXISTS {{.Database}}
