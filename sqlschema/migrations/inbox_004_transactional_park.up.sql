-- Transactional mode parks a key when its handler returns a Permanent
-- error. An operator's Release turns a parked key into failed, and the next
-- transactional claim of a failed key takes it over. Lease mode records
-- failed too, for its own retries; a transactional claim must never take
-- those over (the two modes must not share a consumer name, and the claim
-- says so). This column tells the records a transactional consumer parked.
ALTER TABLE {{.Inbox}} ADD COLUMN IF NOT EXISTS parked_by_transaction boolean NOT NULL DEFAULT false;
