-- Outbox: messages written by handlers inside their transaction, waiting for
-- the relay. Rows are deleted once the destination publisher confirmed them,
-- so the table holds only the pending backlog.
--   attempts        the row's permanent failures (the publisher or
--                   RelayConfig.IsPermanent says the message is refused for
--                   good); at RelayConfig.MaxAttempts the row is
--                   quarantined. Every other failure (the broker's state) is
--                   retried after the backoff and never counts.
--   last_error      the last failure's error
--   failures        every failed publish of the row; drives its backoff
--   next_attempt_at the relay skips the row until then (NULL: due now)
--   quarantined_at  set when the row is quarantined: the relay skips it
--                   (reported by PendingStats) instead of blocking the rows
--                   behind it forever, until an operator requeues it
--   ordering_key    per-key order (docs/ordering.md): a row with a key is
--                   relayed only after every earlier row of its key (lower
--                   id) was confirmed by the broker and deleted. Writers of
--                   one key are serialized by a transaction-level advisory
--                   lock that the INSERT takes before it draws the ids, so
--                   the ids of a key follow the commits of its transactions
--                   (with the id sequence's CACHE 1, the default). NULL: no
--                   key, relayed in no particular order
CREATE TABLE IF NOT EXISTS {{.Outbox}} (
    id              bigserial   PRIMARY KEY,
    topic           text        NOT NULL,
    uuid            text        NOT NULL,
    payload         bytea       NOT NULL,
    metadata        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at      timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    failures        integer     NOT NULL DEFAULT 0,
    next_attempt_at timestamptz,
    quarantined_at  timestamptz,
    ordering_key    text
);
-- The failed rows the relay retries, oldest first, at most half a batch when
-- enough others wait: few, unless the broker was down.
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "failing"}} ON {{.Outbox}} (id) WHERE failures > 0 AND quarantined_at IS NULL;
-- Finding quarantined rows (outbox.FindRows, CountRows, RequeueMatching,
-- DiscardMatching): by time, by message UUID, and by a metadata field such as
-- a business id (metadata @> a JSON object of the fields sought). Each index
-- is partial, over the quarantined rows only: the relay's inserts and
-- deletes (quarantined_at NULL) add no entry to any of them, and the set is
-- the few rows the broker refused for good. The other filters (topic, reason
-- text, ids) read the quarantined rows through the first index. Failing rows
-- not quarantined are found through the failing index above.
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "quarantined_at"}} ON {{.Outbox}} (quarantined_at) WHERE quarantined_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "quarantined_uuid"}} ON {{.Outbox}} (uuid) WHERE quarantined_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "quarantined_metadata"}} ON {{.Outbox}} USING gin (metadata jsonb_path_ops) WHERE quarantined_at IS NOT NULL;
-- Is there an earlier row of this key? The relay asks it of each row it
-- walks for a batch (only a key's first row left, its head, is taken), and
-- takes the rows right after the heads from it.
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "ordering_key"}} ON {{.Outbox}} (ordering_key, id) WHERE ordering_key IS NOT NULL;
-- The keys blocked by a failing or quarantined row, and the first such row
-- of each (outbox.PendingStats): few entries, the failed rows that have a
-- key.
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "ordering_key_failed"}} ON {{.Outbox}} (ordering_key, id) WHERE ordering_key IS NOT NULL AND failures > 0;
