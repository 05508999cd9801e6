-- Failure accounting of the relay (issue 8). A failed row is deferred
-- instead of retried at once, so the rows behind it keep flowing, and it is
-- blamed only on evidence that the broker accepted other messages around its
-- failure; an outage (every publish failing) blames nothing.
--   failures        every failed publish of the row; drives its backoff.
--   attempts        (outbox_002) keeps meaning the failures blamed on the
--                   row; at RelayConfig.MaxAttempts it is quarantined.
--   next_attempt_at the relay skips the row until then (NULL: due now).
--   fail_mark       value of the accepted sequence below at the row's last
--                   failure: a later value proves the broker accepted
--                   something since.
--   blame_pending   the last failure had an accepted message before it; it
--                   is blamed if one is also accepted before the next attempt.
--   quarantined_at  set when the row is quarantined; the relay skips it.
-- Rows that outbox_002's relay skipped (attempts >= its MaxAttempts) are
-- tried once more; a failure then quarantines them again at once.
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS failures integer NOT NULL DEFAULT 0;
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS next_attempt_at timestamptz;
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS fail_mark bigint;
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS blame_pending boolean NOT NULL DEFAULT false;
ALTER TABLE {{.Outbox}} ADD COLUMN IF NOT EXISTS quarantined_at timestamptz;

-- Advanced (nextval) once per relay batch of which the publisher accepted at
-- least one message, by every relay of this table: evidence, across batches
-- and instances and without a clock, that the broker accepted something
-- since a given value. CACHE 1 keeps last_value exact.
CREATE SEQUENCE IF NOT EXISTS {{.OutboxSequence "accepted"}} AS bigint CACHE 1;
