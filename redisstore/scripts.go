package redisstore

import "github.com/redis/go-redis/v9"

// The store's Lua scripts. Each runs atomically on the server, reads the
// server's clock (TIME: every worker's lease is measured by one clock, as
// with PostgreSQL's now()), and touches only the keys it is given: the
// key's record (KEYS[1], a hash) and its consumer's parked set (KEYS[2], a
// sorted set scored by first-seen time), which share a Cluster hash slot.
//
// Record fields: status (processing, done, failed, parked), attempts,
// token (the fencing token of the processing attempt), lease_until_ms,
// first_seen_ms, processed_at_ms, last_error, interrupted (0/1),
// interruptions, duplicates. Times are Unix milliseconds of the server.
//
// A park also keeps the message it parked (inboxdb.ParkedMessage, as
// inboxdb.ParkedMessage.Row makes it): m_uuid, m_topic, m_payload (absent
// when the payload is not kept; empty when it was empty), m_size (the
// payload's size in bytes), m_meta (a JSON object of strings), m_reason
// (why it was parked: last_error changes with the attempts of a released
// key) and parked_at_ms, written by the script that parks, replacing what
// an earlier park kept. A parked record never expires (every script that
// parks persists it). They go with the
// record: Forget deletes them, a release leaves them until the record is
// parked again or expires.

// luaNow is the prologue of every script that needs the time.
const luaNow = `local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
`

// luaKeep defines keep(rec, i, reason): when ARGV[i] is '1', the parked
// message in ARGV[i+1..i+6] (uuid, topic, '1' when the payload is kept,
// payload, size, metadata JSON) is written into the record with the
// reason of the park; '0' keeps nothing. See messageArgs.
const luaKeep = `local function keep(rec, i, reason)
	if ARGV[i] ~= '1' then return end
	redis.call('HSET', rec, 'm_uuid', ARGV[i+1], 'm_topic', ARGV[i+2], 'm_size', ARGV[i+5], 'm_meta', ARGV[i+6], 'm_reason', reason, 'parked_at_ms', now)
	if ARGV[i+3] == '1' then
		redis.call('HSET', rec, 'm_payload', ARGV[i+4])
	else
		redis.call('HDEL', rec, 'm_payload')
	end
end
`

// claimScript: ARGV token, lease ms, max interrupted (0: no bound), the
// message key (the parked set's member), then the message to keep if the
// claim parks: ARGV[5] '1' with the message (see luaKeep), '0' for none,
// or '?' when the caller has one but did not send it (the usual case: most
// claims do not park): a claim that would park then changes nothing and
// returns the outcome 'message', and the caller runs it again with the
// message. Returns {outcome, attempts,
// lease_until_ms, interrupted, parked_now, first_seen_ms, last_error}.
var claimScript = redis.NewScript(luaNow + luaKeep + `
local rec, token, lease, maxi, member = KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local until_ms = now + lease
local f = redis.call('HMGET', rec, 'status', 'attempts', 'lease_until_ms', 'first_seen_ms', 'interrupted', 'interruptions', 'last_error')
local status = f[1]
if not status then
	redis.call('DEL', rec)
	redis.call('HSET', rec, 'status', 'processing', 'attempts', 1, 'token', token, 'lease_until_ms', until_ms,
		'first_seen_ms', now, 'interrupted', 0, 'interruptions', 0, 'duplicates', 0)
	return {'acquired', 1, until_ms, 0, 0, now, ''}
end
local attempts, lu, fs = tonumber(f[2]) or 0, tonumber(f[3]) or 0, tonumber(f[4]) or 0
local interrupted, interruptions, last_error = f[5] == '1', tonumber(f[6]) or 0, f[7] or ''
if status == 'done' or status == 'parked' or status == 'discarded' then
	redis.call('HINCRBY', rec, 'duplicates', 1)
	local outcome = 'duplicate'
	if status == 'parked' then outcome = 'parked' end
	return {outcome, attempts, 0, 0, 0, fs, last_error}
end
if status == 'failed' then
	-- A failed record that was parked after an interrupted attempt and then
	-- released keeps the interruption: the effect is still unknown.
	redis.call('HSET', rec, 'status', 'processing', 'attempts', attempts + 1, 'token', token, 'lease_until_ms', until_ms, 'interrupted', 0)
	redis.call('PERSIST', rec)
	local was = 0
	if interrupted then was = 1 end
	return {'acquired', attempts + 1, until_ms, was, 0, fs, last_error}
end
if lu >= now then
	return {'busy', attempts, lu, 0, 0, fs, last_error}
end
-- Processing with an expired lease: the attempt was interrupted.
if maxi > 0 and interruptions + 1 >= maxi then
	if ARGV[5] == '?' then
		return {'message', attempts, 0, 0, 0, fs, last_error}
	end
	local reason = string.format('lease expired during attempt %d: the worker stopped mid-attempt; whether its effect happened is unknown (%d interrupted attempts; retries stop at %d)',
		attempts, interruptions + 1, maxi)
	redis.call('HSET', rec, 'status', 'parked', 'interrupted', 1, 'interruptions', interruptions + 1, 'processed_at_ms', now, 'last_error', reason)
	redis.call('HDEL', rec, 'token', 'lease_until_ms')
	redis.call('ZADD', KEYS[2], fs, member)
	redis.call('PERSIST', rec)
	keep(rec, 5, reason)
	return {'parked', attempts, 0, 1, 1, fs, reason}
end
redis.call('HSET', rec, 'attempts', attempts + 1, 'token', token, 'lease_until_ms', until_ms, 'interrupted', 0, 'interruptions', interruptions + 1)
return {'acquired', attempts + 1, until_ms, 1, 0, fs, last_error}
`)

// luaOwned is the fencing check: the record is processing with ARGV[1].
const luaOwned = `local f = redis.call('HMGET', KEYS[1], 'status', 'token')
if f[1] ~= 'processing' or f[2] ~= ARGV[1] then return -1 end
`

// extendScript: ARGV token, lease ms. Returns the new lease end, or -1
// when the attempt no longer owns the key.
var extendScript = redis.NewScript(luaOwned + luaNow + `
local until_ms = now + tonumber(ARGV[2])
redis.call('HSET', KEYS[1], 'lease_until_ms', until_ms)
return until_ms
`)

// completeScript: ARGV token, done TTL ms. Records done and starts the
// deduplication window. Returns 1, or -1 when the attempt no longer owns
// the key.
var completeScript = redis.NewScript(luaOwned + luaNow + `
redis.call('HSET', KEYS[1], 'status', 'done', 'processed_at_ms', now)
redis.call('HDEL', KEYS[1], 'token', 'lease_until_ms', 'last_error')
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
`)

// failScript: ARGV token, error text, "1" to park, done TTL ms, member,
// then the message a park keeps (ARGV[6..12], see luaKeep). Returns 1, or
// -1 when the attempt no longer owns the key.
var failScript = redis.NewScript(luaOwned + luaNow + luaKeep + `
local rec = KEYS[1]
redis.call('HDEL', rec, 'token', 'lease_until_ms')
redis.call('HSET', rec, 'last_error', ARGV[2], 'processed_at_ms', now)
if ARGV[3] == '1' then
	redis.call('HSET', rec, 'status', 'parked')
	redis.call('ZADD', KEYS[2], tonumber(redis.call('HGET', rec, 'first_seen_ms')) or now, ARGV[5])
	redis.call('PERSIST', rec)
	keep(rec, 6, ARGV[2])
else
	redis.call('HSET', rec, 'status', 'failed')
	redis.call('PEXPIRE', rec, ARGV[4])
end
return 1
`)

// parkInterruptedScript: ARGV token, reason, member, then the message to
// keep (ARGV[4..10], see luaKeep). Returns 1, or -1 when the attempt no
// longer owns the key.
var parkInterruptedScript = redis.NewScript(luaOwned + luaNow + luaKeep + `
local rec = KEYS[1]
redis.call('HDEL', rec, 'token', 'lease_until_ms')
redis.call('HSET', rec, 'status', 'parked', 'interrupted', 1, 'last_error', ARGV[2], 'processed_at_ms', now)
redis.call('HINCRBY', rec, 'interruptions', 1)
redis.call('ZADD', KEYS[2], tonumber(redis.call('HGET', rec, 'first_seen_ms')) or now, ARGV[3])
redis.call('PERSIST', rec)
keep(rec, 4, ARGV[2])
return 1
`)

// releaseScript: ARGV member, done TTL ms, then a guard (luaGuard; -2
// when it does not hold). Turns a parked record into
// failed (its next claim runs it again). A record that keeps a parked
// message (m_uuid, see parked_scripts.go) keeps it, stays in the parked
// set and does not expire, until the message is replayed or discarded;
// one without expires after the done TTL and leaves the set. Returns 1, or
// 0 when it was not parked (a stale entry of the parked set is removed
// either way).
var releaseScript = redis.NewScript(luaNow + luaGuard + `
if not guarded(KEYS[1], 3) then return -2 end
local message = redis.call('HEXISTS', KEYS[1], 'm_uuid') == 1
if not message then redis.call('ZREM', KEYS[2], ARGV[1]) end
if redis.call('HGET', KEYS[1], 'status') ~= 'parked' then return 0 end
redis.call('HSET', KEYS[1], 'status', 'failed', 'processed_at_ms', now)
if not message then redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 1
`)

// forgetScript: ARGV member, then a guard (luaGuard). Deletes the record
// (with the message a park kept in it) and its parked entry. Returns 1
// when a record existed, or -2 (guardFailed) when the guard did not hold.
var forgetScript = redis.NewScript(luaGuard + `
if not guarded(KEYS[1], 2) then return -2 end
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('DEL', KEYS[1])
`)
