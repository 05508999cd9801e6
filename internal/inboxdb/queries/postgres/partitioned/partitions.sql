-- Retention and maintenance of the partitioned layout (partitioned.go).
-- A record to keep although its partition is past retention: not done or
-- discarded, or finished after the cutoff ($1). A live lease: processing,
-- lease not expired (such a record is not moved; its partition waits).
--
-- Run-time templates: the statements that name a partition (DETACH,
-- ATTACH, DROP, the count of a detached partition): PostgreSQL takes no
-- parameter for an identifier, and the partition is known only at run
-- time (inboxpart names it from its bounds).

-- name: PurgeCutoff
SELECT now() - make_interval(secs => $1)

-- name: FindKept
SELECT consumer, message_key FROM {{.Inbox}}
WHERE partition_at >= $3 AND partition_at < $4
AND (status NOT IN ('done', 'discarded') OR coalesce(processed_at, first_seen_at) >= $1)
AND NOT (status = 'processing' AND lease_until > now())
LIMIT $2

-- name: LiveLeaseIn
SELECT EXISTS (SELECT 1 FROM {{.Inbox}} WHERE partition_at >= $1 AND partition_at < $2 AND (status = 'processing' AND lease_until > now()))

-- name: KeysLock
SELECT pg_advisory_xact_lock(h) FROM (SELECT DISTINCT {{.LockKey "v.c" "v.k"}} AS h FROM unnest($1::text[], $2::text[]) v(c, k) ORDER BY 1) l

-- name: MoveKept
UPDATE {{.Inbox}} SET partition_at = least(clock_timestamp(), coalesce($6::timestamptz, {{.Frag.NewestEnd}}) - interval '1 microsecond')
WHERE partition_at >= $4 AND partition_at < $5
AND (consumer, message_key) IN (SELECT v.c, v.k FROM unnest($2::text[], $3::text[]) v(c, k))
AND (status NOT IN ('done', 'discarded') OR coalesce(processed_at, first_seen_at) >= $1)
AND NOT (status = 'processing' AND lease_until > now())

-- name: FenceFallbackWrites
SELECT pg_advisory_xact_lock({{.FallbackLockClass}}, hashtext('{{.Inbox}}'))

-- name: DetachConcurrently
ALTER TABLE {{.Inbox}} DETACH PARTITION {{.Run "Partition"}} CONCURRENTLY

-- name: DetachFinalize
ALTER TABLE {{.Inbox}} DETACH PARTITION {{.Run "Partition"}} FINALIZE

-- name: AttachAgain
ALTER TABLE {{.Inbox}} ATTACH PARTITION {{.Run "Partition"}} FOR VALUES FROM ({{.Run "From"}}) TO ({{.Run "To"}})

-- name: DropDetached
DROP TABLE {{.Run "Partition"}}

-- name: CountDetachedAfter
SELECT count(*), count(*) FILTER (WHERE (status NOT IN ('done', 'discarded') OR coalesce(processed_at, first_seen_at) >= $1)) FROM {{.Run "Partition"}}

-- name: CountDetachedOpen
SELECT count(*), count(*) FILTER (WHERE status NOT IN ('done', 'discarded')) FROM {{.Run "Partition"}}
