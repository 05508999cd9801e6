-- An operator's discard of a parked message that keeps the key (without
-- forgetting it) leaves the key 'discarded': nothing waits for an operator
-- any more, so no list, count or alert calls it parked, and a late copy of
-- the message is still acknowledged without running, counted as a
-- duplicate, as a copy of a done key is. Retention ages a discarded record
-- out as a done one.
--
-- The status column's CHECK constraint is replaced by a wider one, found
-- by what it checks (a table renamed into place keeps its former name). It
-- is added NOT VALID: every row satisfies the narrower constraint it
-- replaces, so there is nothing to check, and the table is not scanned
-- under the ALTER's lock; new and updated rows are checked. Running this
-- again replaces the constraint again (ensureClaimFunctions may).
DO $do$
DECLARE c text;
BEGIN
    FOR c IN SELECT conname FROM pg_constraint
        WHERE conrelid = '{{.Inbox}}'::regclass AND contype = 'c' AND conislocal
          AND pg_get_constraintdef(oid) LIKE '%status%'
    LOOP
        EXECUTE format('ALTER TABLE {{.Inbox}} DROP CONSTRAINT %I', c);
    END LOOP;
END
$do$;
ALTER TABLE {{.Inbox}} ADD CONSTRAINT {{.InboxIndex "status_check"}}
    CHECK (status IN ('processing', 'done', 'failed', 'parked', 'discarded')) NOT VALID;
{{if .Partitioned}}
-- The partitioned layout's duplicate count (inbox_008) counts a copy of a
-- discarded key too.
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
