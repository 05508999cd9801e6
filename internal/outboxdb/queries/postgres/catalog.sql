-- The catalog (the CLI's search for the library's tables).

-- name: LibraryTables
-- The library's tables in every schema the user may use, from the catalog
-- alone (no table is read, so a schema dropped meanwhile or a table the
-- user may not read is no error): a table with the inbox's (or the
-- outbox's) first columns, in a schema that holds the library's migrations
-- table ({{.MigrationsTable}}), or that also has the column lease_token
-- (quarantined_at), which a table of the user's of that shape is unlikely
-- to have (tables created with 'migrate sql' and another tool record no
-- migrations). A partition of a partitioned inbox is not a table of its
-- own. The inbox's table of parked messages has neither shape. inbox is
-- true for an inbox table, false for an outbox table.
SELECT schema, name, inbox
FROM (
    SELECT n.nspname::text AS schema, c.relname::text AS name,
           count(*) FILTER (WHERE a.attname IN ('consumer', 'message_key', 'status', 'attempts', 'first_seen_at', 'processed_at')) = 6 AS inbox,
           count(*) FILTER (WHERE a.attname IN ('id', 'topic', 'uuid', 'payload', 'metadata', 'created_at')) = 6 AS outbox,
           bool_or(a.attname = 'lease_token') AS inbox_later,
           bool_or(a.attname = 'quarantined_at') AS outbox_later,
           EXISTS (SELECT 1 FROM pg_catalog.pg_class m
                   WHERE m.relnamespace = n.oid AND m.relname = '{{.MigrationsTable}}' AND m.relkind IN ('r', 'p')) AS versioned
    FROM pg_catalog.pg_class c
    JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
    JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
    WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
      AND n.nspname !~ '^pg_' AND n.nspname <> 'information_schema'
      AND has_schema_privilege(n.oid, 'USAGE')
      AND a.attname IN ('consumer', 'message_key', 'status', 'attempts', 'first_seen_at', 'processed_at', 'lease_token',
                        'id', 'topic', 'uuid', 'payload', 'metadata', 'created_at', 'quarantined_at')
    GROUP BY n.oid, n.nspname, c.relname
) t
WHERE (inbox AND (inbox_later OR versioned)) OR (outbox AND (outbox_later OR versioned))
ORDER BY schema, name
