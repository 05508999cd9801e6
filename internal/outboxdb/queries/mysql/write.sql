-- The writers' statements on MySQL/MariaDB (internal/outboxwrite). There
-- is no NOTIFY: a writer's wake-up is the relay's business.
--
-- Insert and LockKeys take a list of rows whose length is the call's
-- (.Rows: a multi-row VALUES list, one tuple per row; MySQL has no array
-- parameters). New renders them for one row; Store.Insert renders them
-- for the call's count. Insert binds 5 values a row, so its most rows
-- (outboxwrite's maxMessagesPerInsert, 1,000) stay far below MySQL's
-- 65,535 placeholders of one statement.

-- name: LockKeys
-- The ordering keys' locks of one Publish call: one row of the table of
-- key locks per bucket (the key's hash reduced to 16 bits), the call's
-- distinct buckets in ascending order (so that two writers of the same
-- keys cannot deadlock on them). An existing row is not changed, but
-- ON DUPLICATE KEY UPDATE takes InnoDB's exclusive lock of its record (a
-- new row is locked as any inserted row is), held until the transaction
-- ends: a second writer of the key waits here until the first commits or
-- rolls back, and only then draws its rows' ids (Insert, next in the same
-- transaction), so a key's ids follow the commits of its writers.
INSERT INTO {{.OutboxKeyLocks}} (bucket)
VALUES {{range $i := .Rows}}{{if $i}}, {{end}}(?){{end}}
ON DUPLICATE KEY UPDATE bucket = bucket

-- name: Insert
-- The rows of one Publish call, in the order of the call: per row its
-- topic, UUID, payload, metadata (a JSON object as text) and ordering key
-- ('' for none: NULL). A multi-row INSERT of known length is a "simple
-- insert" for InnoDB: its AUTO_INCREMENT ids are drawn in the order of
-- the VALUES list, without the table-level AUTO-INC lock.
INSERT INTO {{.Outbox}} (topic, uuid, payload, metadata, ordering_key, created_at)
VALUES {{range $i := .Rows}}{{if $i}}, {{end}}(?, ?, ?, ?, NULLIF(?, ''), UTC_TIMESTAMP(6)){{end}}

-- name: IDOrder
-- What the relay's start-up check needs to tell whether the ids of one
-- key follow the commits of its writers (Store.IDOrder says why each
-- matters): the storage engine of the outbox table and of its key-lock
-- table (? 1: the key-lock table's name; ? 2: their database, '' for the
-- connection's; ? 3: the outbox table's name), whether the id column draws
-- from AUTO_INCREMENT, and the server's auto_increment_increment. No row
-- when the outbox table does not exist.
SELECT t.ENGINE, coalesce(k.ENGINE, ''),
  coalesce((SELECT c.EXTRA LIKE '%auto_increment%' FROM information_schema.COLUMNS c
            WHERE c.TABLE_SCHEMA = t.TABLE_SCHEMA AND c.TABLE_NAME = t.TABLE_NAME AND c.COLUMN_NAME = 'id'), FALSE),
  @@GLOBAL.auto_increment_increment
FROM information_schema.TABLES t
LEFT JOIN information_schema.TABLES k ON k.TABLE_SCHEMA = t.TABLE_SCHEMA AND k.TABLE_NAME = ?
WHERE t.TABLE_SCHEMA = coalesce(nullif(?, ''), DATABASE()) AND t.TABLE_NAME = ?
