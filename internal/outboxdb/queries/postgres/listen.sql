-- The relay's LISTEN session, and the sessions that look like relays.

-- name: BackendPID
-- The server's process id of the session (a pooler shows itself by
-- another one).
SELECT pg_backend_pid()

-- name: Listen
-- LISTEN on the table's NOTIFY channel.
LISTEN {{.ChannelIdent}}

-- name: LockListener
-- Takes, in the session (for as long as it lasts), the shared advisory
-- lock that marks the session as a relay's LISTEN connection for the
-- outbox table $1 (its quoted name as text): one bigint, the class
-- ListenerLockClass ("eorl") in its high 32 bits and the
-- table's oid in its low 32. Shared: every relay of the table holds it at
-- once; nothing takes it exclusively. It returns true once held, NULL when
-- the table does not exist (nothing is locked then).
SELECT pg_try_advisory_lock_shared(({{.ListenerLockClass}}::bigint << 32) | to_regclass($1::text)::oid::bigint)

-- name: Relays
-- The sessions holding a relay's LISTEN lock (LockListener's: locktype
-- 'advisory', classid the class, objid the table's oid, objsubid 1) or row
-- locks on the outbox table ($1, its quoted name as text), with whether
-- each holds the one and the other.
SELECT a.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), ''), a.backend_start,
       coalesce(a.state, ''), a.state_change,
       EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid
               AND l.locktype = 'advisory' AND l.classid = {{.ListenerLockClass}}::oid AND l.objid = to_regclass($1::text)::oid AND l.objsubid = 1 AND l.granted),
       EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'relation' AND l.relation = to_regclass($1::text)
               AND l.mode = 'RowShareLock' AND l.granted)
FROM pg_stat_activity a
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND a.pid IN (SELECT l.pid FROM pg_locks l
       WHERE (l.locktype = 'advisory' AND l.classid = {{.ListenerLockClass}}::oid AND l.objid = to_regclass($1::text)::oid AND l.objsubid = 1 AND l.granted)
          OR (l.locktype = 'relation' AND l.relation = to_regclass($1::text) AND l.mode = 'RowShareLock' AND l.granted))
ORDER BY a.backend_start, a.pid
LIMIT 1000
