package redisstore

import "github.com/redis/go-redis/v9"

// The scripts of the operations on parked messages (parked.go). KEYS are
// the key's record and its consumer's parked set, as for the lease
// scripts; ARGV[1] is the message key (the set's member).
//
// A parked message lives in its key's record: m_uuid, m_topic, m_payload
// (absent when the payload was not kept), m_size, m_meta (a JSON object),
// m_reason, written by the park with parked_at_ms. The record has a
// message while it has m_uuid. A replay in flight marks it: m_replay (the
// replay's token), m_replay_until_ms (when the mark lapses),
// m_replay_from (the status the replay found: parked or failed) and
// m_replay_attempts (the record's attempts then: a delivery since changes
// them).
//
// The parked set holds a consumer's parked keys and, besides, the keys
// whose record still has a message (released, being replayed): a member
// leaves it when its key is neither. Find removes members whose record is
// gone (a released record that expired).

// luaMessageFields are the record's fields of a parked message and of a
// replay's mark.
const luaMessageFields = `'m_uuid', 'm_topic', 'm_payload', 'm_size', 'm_meta', 'm_reason', 'm_replay', 'm_replay_until_ms', 'm_replay_from', 'm_replay_attempts'`

// luaMarkFields are the fields of a replay's mark.
const luaMarkFields = `'m_replay', 'm_replay_until_ms', 'm_replay_from', 'm_replay_attempts'`

// beginReplayScript: ARGV member, token, replay timeout ms, "1" when the
// operator names the topic, then a guard (luaGuard: the park a bulk
// replay found, or the key as an operator's Expect was checked against).
// Checks that the record has a message that can be replayed and no replay
// in flight, releases a parked key (parked → failed, without expiry while
// the replay runs), and marks the message. Returns {'ok', uuid, topic,
// payload, meta, from, reason, attempts, first_seen_ms, parked_at_ms}, or
// {outcome, detail} with outcome gone (no message), changed (the guard
// did not hold), replaying (detail: the mark's end, ms), done, processing,
// not_kept (detail: the size) or no_topic.
var beginReplayScript = redis.NewScript(luaNow + luaGuard + `
local rec = KEYS[1]
local f = redis.call('HMGET', rec, 'status', 'm_uuid', 'm_size', 'm_topic', 'm_replay_until_ms')
local status = f[1]
if not status or not f[2] then return {'gone', ''} end
if not guarded(rec, 5) then return {'changed', ''} end
local until_ms = tonumber(f[5] or '0') or 0
if until_ms > now then return {'replaying', tostring(until_ms)} end
if status == 'done' or status == 'processing' then return {status, ''} end
if redis.call('HEXISTS', rec, 'm_payload') == 0 then return {'not_kept', f[3] or ''} end
if (not f[4] or f[4] == '') and ARGV[4] ~= '1' then return {'no_topic', ''} end
if status == 'parked' then
	redis.call('HSET', rec, 'status', 'failed', 'processed_at_ms', now)
end
redis.call('PERSIST', rec)
local m = redis.call('HMGET', rec, 'm_uuid', 'm_topic', 'm_payload', 'm_meta', 'm_reason', 'attempts', 'first_seen_ms', 'parked_at_ms', 'last_error')
redis.call('HSET', rec, 'm_replay', ARGV[2], 'm_replay_until_ms', now + tonumber(ARGV[3]), 'm_replay_from', status, 'm_replay_attempts', m[6] or '0')
return {'ok', m[1], m[2] or '', m[3] or '', m[4] or '', status, m[5] or m[9] or '', m[6] or '0', m[7] or '0', m[8] or '0'}
`)

// finishReplayScript: ARGV member, token, done TTL ms. After the publish:
// deletes the message and the mark, and the set's member, unless the key
// was parked again since (then the message is that park's: it stays).
// A released record expires after the done TTL, as one Release made.
// Returns 1, 2 when the key was parked again, or 0 when the mark is not
// the replay's (it lapsed and another replay took the message over).
var finishReplayScript = redis.NewScript(`
local rec = KEYS[1]
if redis.call('HGET', rec, 'm_replay') ~= ARGV[2] then return 0 end
redis.call('HDEL', rec, ` + luaMarkFields + `)
local status = redis.call('HGET', rec, 'status')
if status == 'parked' then return 2 end
redis.call('HDEL', rec, ` + luaMessageFields + `)
redis.call('ZREM', KEYS[2], ARGV[1])
if status == 'failed' then redis.call('PEXPIRE', rec, ARGV[3]) end
return 1
`)

// abortReplayScript: ARGV member, token. After a failed publish: removes
// the mark and parks the key again if the replay released it and no
// delivery took it since (the record's attempts are those the replay
// found: a publish that reported an error may still have reached the
// broker, and its copy been taken). Returns 1, or 0 when the mark is not
// the replay's.
var abortReplayScript = redis.NewScript(`
local rec = KEYS[1]
local f = redis.call('HMGET', rec, 'm_replay', 'm_replay_from', 'm_replay_attempts', 'status', 'attempts')
if f[1] ~= ARGV[2] then return 0 end
redis.call('HDEL', rec, ` + luaMarkFields + `)
if f[2] == 'parked' and f[4] == 'failed' and f[3] == f[5] then
	redis.call('HSET', rec, 'status', 'parked')
	redis.call('PERSIST', rec)
end
return 1
`)

// discardScript: ARGV member, "1" to forget the key too, done TTL ms, then
// a guard (luaGuard: the park a bulk discard found, or the key as an
// operator's Expect was checked against). Deletes the message; with
// forget, the whole record while it waits for an operator (parked, or
// failed: released), not a done one (its message processed since: a late
// copy must stay a duplicate) nor a processing one (an attempt holds it).
// Without forget a parked key becomes discarded: it leaves the parked set,
// a late copy is still a duplicate, and the record expires after the done
// TTL as a done one does; a released one leaves the set and expires after
// the done TTL. Returns 1, 0 when the record has no message, -1 when a
// replay of it is in flight, or -2 (guardFailed) when the guard did not
// hold.
var discardScript = redis.NewScript(luaNow + luaGuard + `
local rec = KEYS[1]
local f = redis.call('HMGET', rec, 'status', 'm_uuid', 'm_replay_until_ms')
if not f[1] or not f[2] then return 0 end
if not guarded(rec, 4) then return -2 end
if (tonumber(f[3] or '0') or 0) > now then return -1 end
if ARGV[2] == '1' and (f[1] == 'parked' or f[1] == 'failed') then
	redis.call('DEL', rec)
	redis.call('ZREM', KEYS[2], ARGV[1])
	return 1
end
redis.call('HDEL', rec, ` + luaMessageFields + `)
redis.call('ZREM', KEYS[2], ARGV[1])
if f[1] == 'parked' then
	redis.call('HSET', rec, 'status', 'discarded', 'processed_at_ms', now)
	redis.call('PEXPIRE', rec, ARGV[3])
elseif f[1] == 'failed' then
	redis.call('PEXPIRE', rec, ARGV[3])
end
return 1
`)

// pruneScript: KEYS the parked set, then records; ARGV their members, in
// the same order. Removes from the set the members whose record is gone,
// or is neither parked nor holding a message. Returns the number removed.
var pruneScript = redis.NewScript(`
local n = 0
for i = 2, #KEYS do
	local f = redis.call('HMGET', KEYS[i], 'status', 'm_uuid')
	if not f[1] or (f[1] ~= 'parked' and not f[2]) then
		n = n + redis.call('ZREM', KEYS[1], ARGV[i - 1])
	end
end
return n
`)
