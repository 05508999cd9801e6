-- Pieces of the other files' statements, as {{.Frag.<Name>}}. Not
-- statements of their own.

-- name: RecordColumns
consumer, message_key, status, attempts, duplicates, lease_until, first_seen_at, processed_at, coalesce(last_error, ''), interrupted, interruptions, parked_by_transaction

-- name: ParkedReturning
consumer, message_key, last_error, attempts, first_seen_at, processed_at

-- name: KeepParked
INSERT INTO {{.Parked}} (consumer, message_key, message_uuid, topic, payload, payload_size, metadata, reason, attempts, first_seen_at, parked_at)
SELECT consumer, message_key, $1::text, $2::text, $3::bytea, $4::int, $5::jsonb,
coalesce(last_error, ''), attempts, first_seen_at, coalesce(processed_at, now()) FROM parked
ON CONFLICT (consumer, message_key) DO UPDATE SET message_uuid = EXCLUDED.message_uuid, topic = EXCLUDED.topic,
payload = EXCLUDED.payload, payload_size = EXCLUDED.payload_size, metadata = EXCLUDED.metadata, reason = EXCLUDED.reason,
attempts = EXCLUDED.attempts, first_seen_at = EXCLUDED.first_seen_at, parked_at = EXCLUDED.parked_at

-- name: NewestEnd
(SELECT make_timestamptz(substr(n.d, 1, 4)::int, substr(n.d, 5, 2)::int, substr(n.d, 7, 2)::int, {{.PartHour}}, 0, 0, 'UTC') + interval '{{.PartStep}}'
FROM (SELECT substr(max(c.relname::text), {{.PartPrefixLen}} + 1) AS d FROM pg_catalog.pg_inherits i JOIN pg_catalog.pg_class c ON c.oid = i.inhrelid
WHERE i.inhparent = '{{.Inbox}}'::regclass AND NOT i.inhdetachpending AND c.relname::text ~ '^{{.PartPrefix}}[0-9]{ {{- .PartDigits -}} }$') n)
