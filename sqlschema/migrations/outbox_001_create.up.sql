-- Outbox: messages written by handlers inside their transaction, waiting for
-- the relay. Rows are deleted once the destination publisher confirmed them,
-- so the table holds only the pending backlog.
CREATE TABLE IF NOT EXISTS {{.Outbox}} (
    id         bigserial   PRIMARY KEY,
    topic      text        NOT NULL,
    uuid       text        NOT NULL,
    payload    bytea       NOT NULL,
    metadata   jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at timestamptz NOT NULL DEFAULT now()
);
