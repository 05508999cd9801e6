-- Outbox (MySQL 8.0.1+ / MariaDB 10.6+, InnoDB): the columns mean what they
-- mean in the PostgreSQL table (migrations/postgres/outbox_001_create.up.sql).
-- Differences, each for a reason of the engine (docs/mysql.md):
--   id            AUTO_INCREMENT, drawn by the INSERT after it holds its
--                 ordering keys' row locks in the key-lock table below, so
--                 that the ids of a key follow the commits of its writers
--   timestamps    DATETIME(6) in UTC, written with UTC_TIMESTAMP(6)
--   indexes       no partial indexes: the quarantine indexes cover every
--                 row (their key is NULL for the relay's rows)
-- Statements are separated by a line ending in ";".
CREATE TABLE IF NOT EXISTS {{.Outbox}} (
    id              BIGINT        NOT NULL AUTO_INCREMENT,
    topic           VARCHAR(1024) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    uuid            VARCHAR(255)  CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL,
    payload         LONGBLOB      NOT NULL,
    metadata        JSON          NOT NULL,
    created_at      DATETIME(6)   NOT NULL,
    attempts        INT           NOT NULL DEFAULT 0,
    last_error      TEXT          NULL,
    failures        INT           NOT NULL DEFAULT 0,
    next_attempt_at DATETIME(6)   NULL,
    quarantined_at  DATETIME(6)   NULL,
    ordering_key    VARBINARY(1024) NULL,
    PRIMARY KEY (id),
    KEY {{.OutboxIndex "failing"}} (failures, quarantined_at, id),
    KEY {{.OutboxIndex "quarantined_at"}} (quarantined_at),
    KEY {{.OutboxIndex "quarantined_uuid"}} (quarantined_at, uuid),
    KEY {{.OutboxIndex "ordering_key"}} (ordering_key, id)
) ENGINE = InnoDB;

-- The ordering keys' locks: PostgreSQL's transaction-level advisory locks
-- have no MySQL equivalent (GET_LOCK is held by the session, not the
-- transaction: it survives COMMIT and a pooled connection's reuse). A
-- writer upserts the rows of its keys' buckets here (a bucket is the
-- key's lock hash folded to 16 bits), in ascending order, with
-- INSERT ... ON DUPLICATE KEY UPDATE bucket = bucket, before it inserts its
-- messages: InnoDB holds their exclusive record locks until the writer's
-- transaction ends, so writers of one key are serialised in commit order,
-- and so are their ids. Two keys of one bucket only serialise their
-- writers. The table holds one small row per bucket ever used (at most
-- 2^16); no other statement reads it.
CREATE TABLE IF NOT EXISTS {{.OutboxKeyLocks}} (
    bucket INT NOT NULL,
    PRIMARY KEY (bucket)
) ENGINE = InnoDB;
