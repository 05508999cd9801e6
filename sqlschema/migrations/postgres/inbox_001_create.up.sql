-- Inbox: one row per (consumer, message key) that a handler has claimed.
-- Keys are compared byte-wise (COLLATE "C"): identity needs no linguistic
-- ordering, and byte comparison keeps the primary-key insert cheap.
-- In transactional mode the row is inserted with status 'done' in the same
-- transaction as the handler's writes; lease mode uses the other statuses.
--   status        processing, done, failed, parked, or discarded: an
--                 operator discarded the key's parked message and kept the
--                 key, so nothing waits for an operator any more and a late
--                 copy is acknowledged without running, counted as a
--                 duplicate, as a copy of a done key is; retention ages it
--                 out as a done record
--   processed_at  when the record last finished (done, failed or
--                 released): retention ages a record from it, never from
--                 first sight, so that a key parked for days and completed
--                 today is kept as long as one completed today
--   partition_at  (partitioned layout) when the record entered its
--                 partition: clock_timestamp() at insert, moved forward by
--                 retention for a record that must outlive its partition.
--                 No default: a claim that does not know the layout fails
--                 here (NOT NULL) instead of inserting a second record of a
--                 key that lives in another partition
-- Lease mode:
--   interrupted   the latest attempt was cut off by its lease expiring, so
--                 whether its external effect happened is unknown; kept when
--                 the key is parked and released, so that the released
--                 attempt is told
--   lease_token   unique to each claim: extension, completion and failure of
--                 an attempt match it, so a stale worker can never act on a
--                 later claim's row, even after Forget restarted the attempt
--                 count at 1
--   interruptions how many attempts of the key ended interrupted (lease
--                 expired mid-attempt, or completion failed after the
--                 handler ran); retries stop, and the key is parked, after
--                 the middleware's MaxInterruptedAttempts
-- Transactional mode:
--   parked_by_transaction  the record was parked by a transactional
--                 consumer (its handler returned a Permanent error). An
--                 operator's Release turns a parked key into failed, and the
--                 next transactional claim of a failed key takes it over;
--                 lease mode records failed too, for its own retries, and a
--                 transactional claim must never take those over (the two
--                 modes must not share a consumer name, and the claim says
--                 so)
CREATE TABLE IF NOT EXISTS {{.Inbox}} (
    consumer      text        COLLATE "C" NOT NULL,
    message_key   text        COLLATE "C" NOT NULL,
    status        text        NOT NULL DEFAULT 'done',
    attempts      integer     NOT NULL DEFAULT 1,
    duplicates    bigint      NOT NULL DEFAULT 0,
    lease_until   timestamptz,
    first_seen_at timestamptz NOT NULL DEFAULT now(),
    processed_at  timestamptz,
    last_error    text,
{{- if .Partitioned}}
    partition_at  timestamptz NOT NULL,
{{- end}}
    interrupted   boolean     NOT NULL DEFAULT false,
    lease_token   uuid,
    interruptions integer     NOT NULL DEFAULT 0,
    parked_by_transaction boolean NOT NULL DEFAULT false,
    CONSTRAINT {{.InboxIndex "status_check"}}
        CHECK (status IN ('processing', 'done', 'failed', 'parked', 'discarded')),
{{- if .Partitioned}}
    -- A partitioned table's unique keys must include the partition key:
    -- (consumer, message_key) is unique across partitions by the claim's
    -- per-key advisory lock and look-up instead (docs/retention.md).
    PRIMARY KEY (consumer, message_key, partition_at)
) PARTITION BY RANGE (partition_at);
-- Partition retention keeps the records that finished recently: this BRIN
-- index finds them in a partition about to be dropped without a scan.
CREATE INDEX IF NOT EXISTS {{.InboxIndex "finished_brin"}}
    ON {{.Inbox}} USING brin ((coalesce(processed_at, first_seen_at)));
{{- else}}
    PRIMARY KEY (consumer, message_key)
);
{{- end}}
-- Retention purges by age. A BRIN index is a few pages for millions of rows
-- (first_seen_at grows with insertion order) and costs the hot insert path
-- almost nothing, unlike a second btree.
CREATE INDEX IF NOT EXISTS {{.InboxIndex "first_seen_brin"}}
    ON {{.Inbox}} USING brin (first_seen_at);
-- Lease mode's open records (processing, failed, parked, discarded) are
-- few; this partial index finds them (parked keys for operators, metrics)
-- without scanning the table. Transactional mode inserts only 'done' rows,
-- which the index skips, so its hot path does not pay for it.
CREATE INDEX IF NOT EXISTS {{.InboxIndex "open"}}
    ON {{.Inbox}} (status, consumer) WHERE status <> 'done';

-- Parked messages: the message a key was parked with (a Permanent handler
-- error, lease mode's interruptions or a completion that can never commit,
-- group commit's give-ups), written in the same statement or transaction as
-- the park, so that an operator can find it (by consumer, key, message UUID,
-- reason, time, or a metadata field such as a business id) and replay it
-- (released, and written to the outbox for the topic it came from, in one
-- transaction) or discard it. A row lives until replayed, discarded or its
-- key forgotten: retention (Purge) never removes it.
--   topic        the topic it was consumed from ('' when unknown)
--   payload      NULL when it was over the middleware's limit (payload_size
--                says how large it was): such a message cannot be replayed
--   metadata     as the message had it (JSON object of strings)
--   reason       why it was parked (the error)
--   attempts     the key's attempts when it was parked
CREATE TABLE IF NOT EXISTS {{.InboxParked}} (
    consumer      text        NOT NULL,
    message_key   text        NOT NULL,
    message_uuid  text        NOT NULL,
    topic         text        NOT NULL DEFAULT '',
    payload       bytea,
    payload_size  integer     NOT NULL,
    metadata      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    reason        text        NOT NULL DEFAULT '',
    attempts      integer     NOT NULL DEFAULT 0,
    first_seen_at timestamptz NOT NULL,
    parked_at     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_key)
);
-- Listing by time, finding by message UUID and by a metadata field
-- (metadata @> a JSON object of the fields sought).
CREATE INDEX IF NOT EXISTS {{.InboxIndex "parked_at"}} ON {{.InboxParked}} (parked_at);
CREATE INDEX IF NOT EXISTS {{.InboxIndex "parked_uuid"}} ON {{.InboxParked}} (message_uuid);
CREATE INDEX IF NOT EXISTS {{.InboxIndex "parked_metadata"}} ON {{.InboxParked}} USING gin (metadata jsonb_path_ops);
-- Listing one consumer's parked messages (FindParked with a consumer: the
-- CLI's parked list, the console's search) in FindParked's order, oldest
-- parked first and then by key in byte order (a consumer's messages often
-- share a parked_at: those parked by one statement). The consumer's first
-- page is then the first entries of its range, read from the index alone
-- (its keys, then their rows by the primary key), instead of a walk of the
-- parked_at index that skips every other consumer's messages: the whole
-- table when the consumer's are all recent (an incident). Since, before,
-- the page cursor and a tenant (a key prefix) are conditions on its columns
-- too.
CREATE INDEX IF NOT EXISTS {{.InboxIndex "parked_consumer_at"}} ON {{.InboxParked}} (consumer, parked_at, message_key COLLATE "C");
