-- The plain layout's claims: INSERT ... ON CONFLICT on the primary key
-- (consumer, message_key). The pgx fast path's statements are run-time
-- templates: a multi-statement simple-protocol query takes no parameters,
-- so the consumer and key travel as literals (escaped by pgconn).

-- name: ClaimInsert
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, processed_at)
VALUES ($1, $2, 'done', 1, now())
ON CONFLICT (consumer, message_key) DO NOTHING
RETURNING first_seen_at

-- name: ClaimBatchInsert
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, processed_at)
SELECT $1, v.k, 'done', 1, now() FROM unnest($2::text[]) WITH ORDINALITY v(k, i) ORDER BY v.i
ON CONFLICT (consumer, message_key) DO NOTHING
RETURNING message_key

-- name: ClaimBatchInsertCopies
INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, processed_at, duplicates)
SELECT $1, v.k, 'done', 1, now(), v.n FROM unnest($2::text[], $3::bigint[]) WITH ORDINALITY v(k, n, i) ORDER BY v.i
ON CONFLICT (consumer, message_key) DO NOTHING
RETURNING message_key

-- name: BeginClaimLiteral
BEGIN; INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, processed_at) VALUES ('{{.Run "Consumer"}}', '{{.Run "Key"}}', 'done', 1, now())

-- name: ClaimPrepare
PREPARE {{.Run "Name"}} (text, text) AS INSERT INTO {{.Inbox}} (consumer, message_key, status, attempts, processed_at) VALUES ($1, $2, 'done', 1, now())

-- name: BeginClaimExecute
BEGIN; EXECUTE {{.Run "Name"}}('{{.Run "Consumer"}}', '{{.Run "Key"}}')
