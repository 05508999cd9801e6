-- Inbox: one row per (consumer, message key) that a handler has claimed.
-- Keys are compared byte-wise (COLLATE "C"): identity needs no linguistic
-- ordering, and byte comparison keeps the primary-key insert cheap.
-- In transactional mode the row is inserted with status 'done' in the same
-- transaction as the handler's writes; lease mode uses the other statuses.
{{if .Partitioned}}CREATE TABLE IF NOT EXISTS {{.Inbox}} (
    consumer      text        COLLATE "C" NOT NULL,
    message_key   text        COLLATE "C" NOT NULL,
    status        text        NOT NULL DEFAULT 'done'
                  CHECK (status IN ('processing', 'done', 'failed', 'parked')),
    attempts      integer     NOT NULL DEFAULT 1,
    duplicates    bigint      NOT NULL DEFAULT 0,
    lease_until   timestamptz,
    first_seen_at timestamptz NOT NULL DEFAULT now(),
    processed_at  timestamptz,
    last_error    text,
    -- When the record entered its partition (clock_timestamp() at insert;
    -- moved forward by retention for a record that must outlive its
    -- partition). No default: a claim that does not know the layout fails
    -- here (NOT NULL) instead of inserting a second record of a key that
    -- lives in another partition.
    partition_at  timestamptz NOT NULL,
    -- A partitioned table's unique keys must include the partition key:
    -- (consumer, message_key) is unique across partitions by the claim's
    -- per-key advisory lock and look-up instead (docs/retention.md).
    PRIMARY KEY (consumer, message_key, partition_at)
) PARTITION BY RANGE (partition_at);
-- Partition retention keeps the records that finished recently: this BRIN
-- index finds them in a partition about to be dropped without a scan.
CREATE INDEX IF NOT EXISTS {{.InboxIndex "finished_brin"}}
    ON {{.Inbox}} USING brin ((coalesce(processed_at, first_seen_at)));
{{else}}CREATE TABLE IF NOT EXISTS {{.Inbox}} (
    consumer      text        COLLATE "C" NOT NULL,
    message_key   text        COLLATE "C" NOT NULL,
    status        text        NOT NULL DEFAULT 'done'
                  CHECK (status IN ('processing', 'done', 'failed', 'parked')),
    attempts      integer     NOT NULL DEFAULT 1,
    duplicates    bigint      NOT NULL DEFAULT 0,
    lease_until   timestamptz,
    first_seen_at timestamptz NOT NULL DEFAULT now(),
    processed_at  timestamptz,
    last_error    text,
    PRIMARY KEY (consumer, message_key)
);
{{end}}
-- Retention purges by age. A BRIN index is a few pages for millions of rows
-- (first_seen_at grows with insertion order) and costs the hot insert path
-- almost nothing, unlike a second btree.
CREATE INDEX IF NOT EXISTS {{.InboxIndex "first_seen_brin"}}
    ON {{.Inbox}} USING brin (first_seen_at);
