-- The partitions of a partitioned inbox table (inboxpart.go). Rendered
-- with the layout: {{.Parent}} is the quoted, schema-qualified table.
--
-- Run-time templates: CreatePartition and AttachPartition name the
-- partition, computed at run time from its interval (Layout.Name);
-- PostgreSQL takes no parameter for an identifier, nor for a partition
-- bound.

-- name: List
SELECT c.relname::text, i.inhdetachpending FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = $1::regclass ORDER BY c.relname

-- name: MaintenanceLock
SELECT pg_advisory_xact_lock({{.MaintenanceLockClass}}, hashtext('{{.Parent}}'))

-- name: Now
SELECT now()

-- name: CreatePartition
CREATE TABLE {{.Run "Partition"}} (LIKE {{.Parent}} INCLUDING DEFAULTS INCLUDING CONSTRAINTS)

-- name: AttachPartition
ALTER TABLE {{.Parent}} ATTACH PARTITION {{.Run "Partition"}} FOR VALUES FROM ({{.Run "From"}}) TO ({{.Run "To"}})
