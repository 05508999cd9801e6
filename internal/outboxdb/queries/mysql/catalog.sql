-- The catalog (the CLI's search for the library's tables), MySQL/MariaDB.

-- name: LibraryTables
-- The library's tables in every database (MySQL's schema) the user may
-- see, from information_schema alone (no table is read; it lists only
-- what the user has privileges on): a base table with the inbox's (or the
-- outbox's) first columns, in a database that holds the library's
-- migrations table ({{.MigrationsTable}}), or that also has the column
-- lease_token (quarantined_at), which a table of the user's of that shape
-- is unlikely to have (tables created with 'migrate sql' and another tool
-- record no migrations). The inbox's table of parked messages and the
-- outbox's key-lock table have neither shape. The system databases are
-- left out. inbox is true for an inbox table, false for an outbox table.
SELECT t.table_schema, t.table_name, t.inbox
FROM (
    SELECT c.TABLE_SCHEMA AS table_schema, c.TABLE_NAME AS table_name,
           SUM(c.COLUMN_NAME IN ('consumer', 'message_key', 'status', 'attempts', 'first_seen_at', 'processed_at')) = 6 AS inbox,
           SUM(c.COLUMN_NAME IN ('id', 'topic', 'uuid', 'payload', 'metadata', 'created_at')) = 6 AS outbox,
           MAX(c.COLUMN_NAME = 'lease_token') AS inbox_later,
           MAX(c.COLUMN_NAME = 'quarantined_at') AS outbox_later,
           EXISTS (SELECT 1 FROM information_schema.TABLES m
                   WHERE m.TABLE_SCHEMA = c.TABLE_SCHEMA AND m.TABLE_NAME = '{{.MigrationsTable}}'
                     AND m.TABLE_TYPE = 'BASE TABLE') AS versioned
    FROM information_schema.COLUMNS c
    JOIN information_schema.TABLES b ON b.TABLE_SCHEMA = c.TABLE_SCHEMA AND b.TABLE_NAME = c.TABLE_NAME
    WHERE b.TABLE_TYPE = 'BASE TABLE'
      AND c.TABLE_SCHEMA NOT IN ('mysql', 'information_schema', 'performance_schema', 'sys')
      AND c.COLUMN_NAME IN ('consumer', 'message_key', 'status', 'attempts', 'first_seen_at', 'processed_at', 'lease_token',
                            'id', 'topic', 'uuid', 'payload', 'metadata', 'created_at', 'quarantined_at')
    GROUP BY c.TABLE_SCHEMA, c.TABLE_NAME
) t
WHERE (t.inbox AND (t.inbox_later OR t.versioned)) OR (t.outbox AND (t.outbox_later OR t.versioned))
ORDER BY t.table_schema, t.table_name
