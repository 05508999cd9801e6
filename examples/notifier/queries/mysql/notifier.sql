-- The notifier's own statements on MySQL 8 / MariaDB 10.6+ (queries.go
-- renders them): the same names and parameters as
-- queries/postgres/notifier.sql. {{.Log}} is the quoted table, {{.Schema}}
-- its quoted database (a MySQL schema is a database); values travel as
-- parameters (?), in the order the PostgreSQL statements number them.
-- As in the library's tables: timestamps are DATETIME(6) in UTC, written
-- with UTC_TIMESTAMP(6); the key columns are VARBINARY, compared byte-wise
-- as PostgreSQL compares text (a case-insensitive collation would merge
-- "N-1" and "n-1", a PAD SPACE one "n-1" and "n-1 ").

-- name: CreateLog
-- No lock: MySQL serialises CREATE TABLE IF NOT EXISTS on the table's
-- metadata lock, and a second session finds the table there (a note, not
-- an error). The text columns are utf8mb4 whatever the database's default.
-- notification_id is at most 200 bytes (parseRequest); message_key is the
-- inbox key (VARBINARY(2048), as the inbox's column).
CREATE TABLE IF NOT EXISTS {{.Log}} (
    notification_id VARBINARY(200)  NOT NULL,
    channel         VARCHAR(16)     CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    recipient       LONGTEXT        CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    status          VARCHAR(64)     CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    attempts        INT             NOT NULL,
    message_key     VARBINARY(2048) NOT NULL,
    created_at      DATETIME(6)     NOT NULL,
    updated_at      DATETIME(6)     NOT NULL,
    PRIMARY KEY (notification_id)
) ENGINE = InnoDB

-- name: RecordSent
-- notification_id, channel, recipient, attempts, message_key. VALUES()
-- rather than MySQL 8.0.19's row alias, which MariaDB lacks.
INSERT INTO {{.Log}} (notification_id, channel, recipient, status, attempts, message_key, created_at, updated_at)
VALUES (?, ?, ?, 'sent', ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))
ON DUPLICATE KEY UPDATE status = 'sent', attempts = VALUES(attempts), updated_at = UTC_TIMESTAMP(6)

-- name: SetStatus
-- status, notification_id. MySQL counts the rows changed, not the rows
-- found: a row set to what it holds counts 0 (LockLogRow tells them apart).
UPDATE {{.Log}} SET status = ?, updated_at = UTC_TIMESTAMP(6) WHERE notification_id = ?

-- name: LockLogRow
-- notification_id: one row when the notification is logged. A locking
-- read: it sees the latest committed row, not the transaction's snapshot.
SELECT 1 FROM {{.Log}} WHERE notification_id = ? FOR UPDATE

-- name: CountLog
SELECT count(*) FROM {{.Log}}

-- name: DropSchema
DROP DATABASE IF EXISTS {{.Schema}}
