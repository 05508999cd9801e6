-- The notifier's own statements on PostgreSQL (queries.go renders them):
-- its notification_log table, and what the demo runs. {{.Log}} is the
-- quoted table, {{.Schema}} its quoted schema; values travel as parameters.
-- queries/mysql/notifier.sql holds the same statements for MySQL/MariaDB,
-- with the same names and the same parameters in the same order.

-- name: MigrateLock
-- Serialises concurrent starts (held until the transaction ends): CREATE
-- TABLE IF NOT EXISTS can still collide on the type catalog when two
-- sessions run it at once.
SELECT pg_advisory_xact_lock(hashtext('exactlyonce-notifier-migrate'))

-- name: CreateLog
CREATE TABLE IF NOT EXISTS {{.Log}} (
    notification_id text        PRIMARY KEY,
    channel         text        NOT NULL,
    recipient       text        NOT NULL,
    status          text        NOT NULL,
    attempts        integer     NOT NULL,
    message_key     text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
)

-- name: RecordSent
-- $1 notification_id, $2 channel, $3 recipient, $4 attempts, $5 message_key.
INSERT INTO {{.Log}} (notification_id, channel, recipient, status, attempts, message_key)
VALUES ($1, $2, $3, 'sent', $4, $5)
ON CONFLICT (notification_id) DO UPDATE SET status = 'sent', attempts = excluded.attempts, updated_at = now()

-- name: SetStatus
-- $1 status, $2 notification_id.
UPDATE {{.Log}} SET status = $1, updated_at = now() WHERE notification_id = $2

-- name: LockLogRow
-- $1 notification_id: one row when the notification is logged.
SELECT 1 FROM {{.Log}} WHERE notification_id = $1 FOR UPDATE

-- name: CountLog
SELECT count(*) FROM {{.Log}}

-- name: DropSchema
DROP SCHEMA IF EXISTS {{.Schema}} CASCADE
