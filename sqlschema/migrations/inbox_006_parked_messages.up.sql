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
