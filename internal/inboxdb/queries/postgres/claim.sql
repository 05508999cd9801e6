-- The claims' statements of both layouts (claim.go, claim_batch.go). The
-- statuses a duplicate counts on are Settled's: done, parked, discarded.

-- name: CountDuplicate
UPDATE {{.Inbox}} SET duplicates = duplicates + CASE WHEN status IN ('done', 'parked', 'discarded') THEN 1 ELSE 0 END
WHERE consumer = $1 AND message_key = $2
RETURNING {{.Frag.RecordColumns}}

-- name: Reclaim
UPDATE {{.Inbox}} SET status = 'done', attempts = attempts + 1, processed_at = now(),
lease_until = NULL, lease_token = NULL, last_error = NULL
WHERE consumer = $1 AND message_key = $2 AND status = 'failed' AND parked_by_transaction
RETURNING true

-- name: CountBatchDuplicates
UPDATE {{.Inbox}} SET duplicates = duplicates + CASE WHEN status IN ('done', 'parked', 'discarded') THEN 1 ELSE 0 END
WHERE consumer = $1 AND message_key = ANY ($2::text[])
RETURNING {{.Frag.RecordColumns}}

-- name: CountBatchDuplicatesCopies
UPDATE {{.Inbox}} SET duplicates = duplicates + CASE WHEN status IN ('done', 'parked', 'discarded') THEN v.n
WHEN status = 'failed' AND parked_by_transaction THEN v.n - 1 ELSE 0 END
FROM unnest($2::text[], $3::bigint[]) v(k, n)
WHERE consumer = $1 AND message_key = v.k
RETURNING {{.Frag.RecordColumns}}

-- name: CountInsertedCopies
UPDATE {{.Inbox}} SET duplicates = duplicates + v.n
FROM unnest($2::text[], $3::bigint[]) v(k, n)
WHERE consumer = $1 AND message_key = v.k

-- name: Rollback
ROLLBACK
