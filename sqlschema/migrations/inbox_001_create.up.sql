-- Inbox: one row per (consumer, message key) that a handler has claimed.
-- Keys are compared byte-wise (COLLATE "C"): identity needs no linguistic
-- ordering, and byte comparison keeps the primary-key insert cheap.
-- In transactional mode the row is inserted with status 'done' in the same
-- transaction as the handler's writes; lease mode uses the other statuses.
CREATE TABLE IF NOT EXISTS {{.Inbox}} (
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

-- Retention purges by age. A BRIN index is a few pages for millions of rows
-- (first_seen_at grows with insertion order) and costs the hot insert path
-- almost nothing, unlike a second btree.
CREATE INDEX IF NOT EXISTS {{.InboxIndex "first_seen_brin"}}
    ON {{.Inbox}} USING brin (first_seen_at);
