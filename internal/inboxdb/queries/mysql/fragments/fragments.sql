-- Pieces of the other files' statements, as {{.Frag.<Name>}}. Not
-- statements of their own. The columns are PostgreSQL's (queries/postgres),
-- in its order: Record.scanDest scans both.

-- name: RecordColumns
consumer, message_key, status, attempts, duplicates, lease_until, first_seen_at, processed_at, COALESCE(last_error, ''), interrupted, interruptions, parked_by_transaction

-- name: ParkedColumns
p.consumer, p.message_key, p.message_uuid, p.topic

-- name: ParkedRest
p.payload IS NOT NULL, p.payload_size, p.metadata, p.reason, p.attempts, p.first_seen_at, p.parked_at

-- name: SettledStatus
status IN ('done', 'parked', 'discarded')
