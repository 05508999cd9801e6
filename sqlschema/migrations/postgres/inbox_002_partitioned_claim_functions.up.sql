-- The partitioned layout's claims as functions (the plain layout needs
-- none: its primary key deduplicates). A claim there takes the key's
-- advisory lock, then, in a later statement, looks the key up in every
-- partition and inserts it when absent (docs/retention.md). Sent by the
-- client, that is two statements, and the look-up, a query over every
-- partition, is planned anew at each claim unless the client keeps a
-- prepared statement in the session (not behind PgBouncer in transaction
-- pooling). In a PL/pgSQL function it is one call, one round trip (the
-- pgx fast path sends it with its BEGIN), and PostgreSQL keeps the plans
-- of the function's statements in the server process, where no session
-- state of the client is involved.
--
-- Each function is VOLATILE, so under READ COMMITTED each of its
-- statements takes a new snapshot: the look-up starts after the lock was
-- granted and sees what the lock's previous holder committed. Outside READ
-- COMMITTED the snapshot predates the lock: they refuse to claim. The
-- lock key is the one every other statement that creates a record takes
-- (lease claims, Park, retention's moves: inboxpart.LockKey).
--
-- Only records at clock_timestamp(), in the partition that covers now:
-- while partition maintenance is behind, claims take the fallback lock
-- and place their record in the newest partition by statements of their
-- own.
--
-- Idempotent (CREATE OR REPLACE): Migrate runs it again when the functions
-- are missing although it is recorded, as for a table renamed into place
-- (docs/retention.md), whose functions kept its former name.
{{if .Partitioned}}
-- Claims p_key for p_consumer as done, in the caller's transaction.
-- Returns true when it inserted the record; when the key has one, false,
-- or with p_raise, an error (SQLSTATE 23505), which fails the pgx fast
-- path's BEGIN query as the plain layout's INSERT does.
CREATE OR REPLACE FUNCTION {{.InboxFunction "claim"}}(p_consumer text, p_key text, p_raise boolean)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = '{{.IsolationMarker}} ' || current_setting('transaction_isolation');
    END IF;
    PERFORM pg_advisory_xact_lock({{.LockKey "p_consumer" "p_key"}});
    INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, processed_at, partition_at)
    SELECT p_consumer, p_key, 'done', 1, now(), clock_timestamp()
    WHERE NOT EXISTS (SELECT 1 FROM {{.Inbox}} WHERE consumer = p_consumer AND message_key = p_key);
    IF FOUND THEN
        RETURN true;
    END IF;
    IF p_raise THEN
        RAISE EXCEPTION USING ERRCODE = 'unique_violation', MESSAGE = '{{.DuplicateMarker}}';
    END IF;
    RETURN false;
END
$fn$;

-- Claims the distinct keys p_keys for p_consumer as done, in the caller's
-- transaction (group commit): takes their locks in the order of the lock
-- keys (two batches sharing keys cannot deadlock), then inserts the absent
-- ones. Returns the keys it inserted.
CREATE OR REPLACE FUNCTION {{.InboxFunction "claim_batch"}}(p_consumer text, p_keys text[])
RETURNS SETOF text LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION USING ERRCODE = '0A000',
            MESSAGE = '{{.IsolationMarker}} ' || current_setting('transaction_isolation');
    END IF;
    PERFORM pg_advisory_xact_lock(l.h)
    FROM (SELECT DISTINCT {{.LockKey "p_consumer" "k.k"}} AS h FROM unnest(p_keys) k(k) ORDER BY 1) l;
    RETURN QUERY
    INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, processed_at, partition_at)
    SELECT p_consumer, k.k, 'done', 1, now(), clock_timestamp() FROM unnest(p_keys) k(k)
    WHERE NOT EXISTS (SELECT 1 FROM {{.Inbox}} t WHERE t.consumer = p_consumer AND t.message_key = k.k)
    RETURNING message_key;
END
$fn$;

-- Counts a duplicate delivery of a done, parked or discarded record, under
-- the key's lock (a purge moving the record to another partition holds it:
-- without it the update could fail with SQLSTATE 40001), and returns the
-- record (any status; a record of another status is left unchanged). No
-- row: the key has no record. The columns are listed (rather than the
-- table's row type) so that the function does not depend on the table.
CREATE OR REPLACE FUNCTION {{.InboxFunction "duplicate"}}(p_consumer text, p_key text)
RETURNS TABLE (r_consumer text, r_message_key text, r_status text, r_attempts integer, r_duplicates bigint,
    r_lease_until timestamptz, r_first_seen_at timestamptz, r_processed_at timestamptz, r_last_error text,
    r_interrupted boolean, r_interruptions integer, r_parked_by_transaction boolean)
LANGUAGE plpgsql VOLATILE AS $fn$
BEGIN
    PERFORM pg_advisory_xact_lock({{.LockKey "p_consumer" "p_key"}});
    RETURN QUERY
    UPDATE {{.Inbox}} t SET duplicates = t.duplicates + CASE WHEN t.status IN ('done', 'parked', 'discarded') THEN 1 ELSE 0 END
    WHERE t.consumer = p_consumer AND t.message_key = p_key
    RETURNING t.consumer::text, t.message_key::text, t.status, t.attempts, t.duplicates, t.lease_until, t.first_seen_at,
        t.processed_at, coalesce(t.last_error, ''), t.interrupted, t.interruptions, t.parked_by_transaction;
END
$fn$;
{{end}}
