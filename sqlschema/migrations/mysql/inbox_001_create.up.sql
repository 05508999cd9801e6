-- Inbox (MySQL 8.0.1+ / MariaDB 10.6+, InnoDB): one row per (consumer,
-- message key) that a handler has claimed; the columns mean what they mean
-- in the PostgreSQL table (migrations/postgres/inbox_001_create.up.sql).
-- Differences, each for a reason of the engine (docs/mysql.md):
--   consumer, message_key are VARBINARY: compared byte-wise, as PostgreSQL's
--                 COLLATE "C" does, and within InnoDB's 3072-byte index key
--                 (255 + 2048 bytes)
--   timestamps    DATETIME(6) in UTC, written by the library's statements
--                 with UTC_TIMESTAMP(6) (no defaults: the session's time
--                 zone never enters)
--   indexes       MySQL has no partial or BRIN indexes: the open-records
--                 index and the age index cover every row, so the hot
--                 insert pays for them
--   no partitioned layout: refused at configuration (ErrUnsupported)
-- Statements are separated by a line ending in ";" (Migrate runs them one
-- by one: DDL commits implicitly in MySQL).
CREATE TABLE IF NOT EXISTS {{.Inbox}} (
    consumer      VARBINARY(255)  NOT NULL,
    message_key   VARBINARY(2048) NOT NULL,
    status        VARCHAR(16)     NOT NULL DEFAULT 'done',
    attempts      INT             NOT NULL DEFAULT 1,
    duplicates    BIGINT          NOT NULL DEFAULT 0,
    lease_until   DATETIME(6)     NULL,
    first_seen_at DATETIME(6)     NOT NULL,
    processed_at  DATETIME(6)     NULL,
    last_error    TEXT            NULL,
    interrupted   BOOLEAN         NOT NULL DEFAULT FALSE,
    lease_token   CHAR(36)        CHARACTER SET ascii NULL,
    interruptions INT             NOT NULL DEFAULT 0,
    parked_by_transaction BOOLEAN NOT NULL DEFAULT FALSE,
    PRIMARY KEY (consumer, message_key),
    KEY {{.InboxIndex "first_seen"}} (first_seen_at),
    KEY {{.InboxIndex "open"}} (status, consumer),
    CONSTRAINT {{.InboxIndex "status_check"}}
        CHECK (status IN ('processing', 'done', 'failed', 'parked', 'discarded'))
) ENGINE = InnoDB;

-- Parked messages (as in PostgreSQL's table). metadata is JSON (on
-- MariaDB a LONGTEXT checked by JSON_VALID): found with JSON_CONTAINS,
-- without an index of its own (MySQL has no GIN): a metadata search reads
-- the parked rows it is narrowed to by its other conditions.
CREATE TABLE IF NOT EXISTS {{.InboxParked}} (
    consumer      VARBINARY(255)  NOT NULL,
    message_key   VARBINARY(2048) NOT NULL,
    message_uuid  VARCHAR(255)    CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    topic         VARCHAR(1024)   CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL DEFAULT '',
    payload       LONGBLOB        NULL,
    payload_size  INT             NOT NULL,
    metadata      JSON            NOT NULL,
    reason        TEXT            NOT NULL,
    attempts      INT             NOT NULL DEFAULT 0,
    first_seen_at DATETIME(6)     NOT NULL,
    parked_at     DATETIME(6)     NOT NULL,
    PRIMARY KEY (consumer, message_key),
    KEY {{.InboxIndex "parked_at"}} (parked_at),
    KEY {{.InboxIndex "parked_uuid"}} (message_uuid),
    KEY {{.InboxIndex "parked_consumer_at"}} (consumer, parked_at, message_key)
) ENGINE = InnoDB;
