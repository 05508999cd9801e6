-- The partitioned layout's claim functions (migration inbox_002) and the
-- per-key lock of a writer that creates no record (lockRecord). The pgx
-- fast path's calls are run-time templates (literals, as in plain/claim.sql).

-- name: ClaimFunctionsExist
SELECT to_regprocedure('{{.ClaimFunc}}(text, text, boolean)') IS NOT NULL AND to_regprocedure('{{.ClaimBatchFunc}}(text, text[])') IS NOT NULL AND to_regprocedure('{{.DuplicateFunc}}(text, text)') IS NOT NULL

-- name: ClaimFuncCall
SELECT 1 WHERE {{.ClaimFunc}}($1::text, $2::text, false)

-- name: ClaimBatchFuncCall
SELECT k FROM {{.ClaimBatchFunc}}($1::text, $2::text[]) k

-- name: BeginClaimFunc
BEGIN; SELECT {{.ClaimFunc}}('{{.Run "Consumer"}}', '{{.Run "Key"}}', true)

-- name: DuplicateFuncCall
SELECT * FROM {{.DuplicateFunc}}('{{.Run "Consumer"}}', '{{.Run "Key"}}')

-- name: RollbackDuplicateFuncCall
ROLLBACK; SELECT * FROM {{.DuplicateFunc}}('{{.Run "Consumer"}}', '{{.Run "Key"}}')

-- name: KeyLock
SELECT pg_advisory_xact_lock({{.LockKey "$1::text" "$2::text"}})
