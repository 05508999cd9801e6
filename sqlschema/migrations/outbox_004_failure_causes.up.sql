-- Failure accounting by cause. A row is quarantined only for failures that
-- are the message's own (the publisher or RelayConfig.IsPermanent says so):
--   failures        every failed publish of the row; drives its backoff.
--   attempts        the permanent failures; at RelayConfig.MaxAttempts the
--                   row is quarantined.
--   next_attempt_at the relay skips the row until then.
-- Every other failure (the broker's state) is retried after the backoff and
-- never counts. The evidence outbox_003 kept to infer blame from the timing
-- of other rows' acceptance is dropped: relays of earlier versions read it,
-- so stop them before migrating. Failures it blamed are forgotten (a row it
-- quarantined stays quarantined until requeued).
UPDATE {{.Outbox}} SET attempts = 0 WHERE attempts > 0 AND quarantined_at IS NULL;
ALTER TABLE {{.Outbox}} DROP COLUMN IF EXISTS fail_mark;
ALTER TABLE {{.Outbox}} DROP COLUMN IF EXISTS blame_pending;
DROP SEQUENCE IF EXISTS {{.OutboxSequence "accepted"}};
-- The failed rows the relay retries, oldest first, at most half a batch when
-- enough others wait: few, unless the broker was down.
CREATE INDEX IF NOT EXISTS {{.OutboxIndex "failing"}} ON {{.Outbox}} (id) WHERE failures > 0 AND quarantined_at IS NULL;
