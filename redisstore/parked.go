package redisstore

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/parked"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// The operators' view of parked messages in Redis, the counterpart of
// inbox.Store's FindParked, CountParked, GetParked, ReplayParked and
// DiscardParked, with the same types, filters and errors
// (inbox.ErrNotParked, inbox.ErrNotReplayable, inbox.ErrInvalidFilter,
// inbox.ErrChanged; and inbox.ErrReplayInProgress, which the PostgreSQL
// inbox, replaying in one transaction, never returns).
//
// Cost: Redis has no index but the consumer's parked set. Every find,
// count and bulk operation reads the whole set and, for each member, its
// record's fields except the payload (pipelined, 1000 per round trip),
// then filters in Go: O(parked keys of the consumer) in time and memory,
// whatever the filter; hence a consumer is required
// (ParkedFilter.Consumer). Payloads are read only for the messages of the
// page.

// parkedEntry is a member of a parked set, read.
type parkedEntry struct {
	msg        inbox.ParkedMessage
	parkedAtMS string // parked_at_ms as read: the park the entry is of
}

// entryFields are the record fields scanParked reads, in this order.
var entryFields = []string{"status", "m_uuid", "m_topic", "m_size", "m_meta", "last_error", "attempts",
	"first_seen_ms", "parked_at_ms", "processed_at_ms", "m_reason"}

// entryIndex is the position of each of entryFields.
var entryIndex = func() map[string]int {
	m := make(map[string]int, len(entryFields))
	for i, f := range entryFields {
		m[f] = i
	}
	return m
}()

// readParked makes the parked message of (consumer, key) out of its
// record's fields (field returns "" for an absent one), without the
// payload; kept says whether the record has m_payload.
func readParked(consumer, key string, field func(string) string, kept bool) (inbox.ParkedMessage, error) {
	num := func(f string) int64 { n, _ := strconv.ParseInt(field(f), 10, 64); return n }
	md := map[string]string{}
	if meta := field("m_meta"); meta != "" {
		if err := json.Unmarshal([]byte(meta), &md); err != nil {
			return inbox.ParkedMessage{}, fmt.Errorf("metadata of %q for %q: %w", key, consumer, err)
		}
	}
	parkedAt := num("parked_at_ms")
	if parkedAt == 0 { // a record parked without the time: its last change
		parkedAt = num("processed_at_ms")
	}
	return inbox.ParkedMessage{
		Consumer: consumer, Key: key, UUID: field("m_uuid"), Topic: field("m_topic"), PayloadSize: int(num("m_size")),
		PayloadKept: kept, Metadata: md, Reason: cmp.Or(field("m_reason"), field("last_error")), Attempts: int(num("attempts")),
		FirstSeenAt: fromMS(num("first_seen_ms")), ParkedAt: fromMS(parkedAt), Status: field("status"),
		Version: parked.MessageVersion(field("m_uuid"), fromMS(parkedAt), int(num("attempts"))),
	}, nil
}

// scanChunk is the number of records read per pipelined round trip.
const scanChunk = 1000

// scanParked reads the consumer's parked set and returns the messages that
// match f (without payloads), oldest parked first, then by key. Members
// whose record is gone, or holds neither a park nor a message, are pruned
// from the set. With f.MaxScan, a set of more than MaxScan members is
// refused (f.TooBroad): it reads MaxScan+1 of them at most.
func (s *Store) scanParked(ctx context.Context, f parked.Filter) ([]parkedEntry, error) {
	b := s.b
	stop := int64(-1)
	if f.MaxScan > 0 {
		stop = int64(f.MaxScan)
	}
	members, err := b.c.ZRange(ctx, b.parkedKey(f.Consumer), 0, stop).Result()
	if err != nil {
		return nil, err
	}
	if f.MaxScan > 0 && len(members) > f.MaxScan {
		return nil, fmt.Errorf("%w: consumer %q has more than %d parked messages (MaxScan), and the Redis store reads each of them",
			inbox.ErrTooBroad, f.Consumer, f.MaxScan)
	}
	var out []parkedEntry
	var stale []string
	for start := 0; start < len(members); start += scanChunk {
		chunk := members[start:min(start+scanChunk, len(members))]
		fields := make([]*redis.SliceCmd, len(chunk))
		kept := make([]*redis.BoolCmd, len(chunk))
		_, err := b.c.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, k := range chunk {
				fields[i] = p.HMGet(ctx, b.recordKey(f.Consumer, k), entryFields...)
				kept[i] = p.HExists(ctx, b.recordKey(f.Consumer, k), "m_payload")
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
		for i, k := range chunk {
			v := fields[i].Val()
			field := func(name string) string { s, _ := v[entryIndex[name]].(string); return s }
			status := field("status")
			// A record holds a message while it has m_uuid, empty or not (a
			// message without a UUID, keyed by its metadata), as the
			// scripts read it.
			if status == "" || v[entryIndex["m_uuid"]] == nil {
				if status != inboxdb.StatusParked {
					stale = append(stale, k)
				}
				continue
			}
			m, err := readParked(f.Consumer, k, field, kept[i].Val())
			if err != nil {
				return nil, err
			}
			if f.Match(parked.Message{Consumer: m.Consumer, Key: m.Key, UUID: m.UUID, Reason: m.Reason, ParkedAt: m.ParkedAt, Metadata: m.Metadata}) {
				out = append(out, parkedEntry{msg: m, parkedAtMS: field("parked_at_ms")})
			}
		}
	}
	if len(stale) > 0 {
		if err := s.prune(ctx, f.Consumer, stale); err != nil {
			return nil, err
		}
	}
	slices.SortFunc(out, func(a, b parkedEntry) int {
		return cmp.Or(a.msg.ParkedAt.Compare(b.msg.ParkedAt), cmp.Compare(a.msg.Key, b.msg.Key))
	})
	return out, nil
}

// prune removes stale members from the consumer's parked set, checking
// each record again in the script.
func (s *Store) prune(ctx context.Context, consumer string, members []string) error {
	b := s.b
	for start := 0; start < len(members); start += 100 {
		chunk := members[start:min(start+100, len(members))]
		keys := []string{b.parkedKey(consumer)}
		args := make([]any, len(chunk))
		for i, k := range chunk {
			keys = append(keys, b.recordKey(consumer, k))
			args[i] = k
		}
		if err := pruneScript.Run(ctx, b.c, keys, args...).Err(); err != nil {
			return err
		}
	}
	return nil
}

// filter checks f for the Redis store: valid, with a consumer.
func filter(f inbox.ParkedFilter) (parked.Filter, error) {
	pf := parked.Filter{Consumer: f.Consumer, Key: f.Key, MessageUUID: f.MessageUUID, Tenant: f.Tenant, Reason: f.Reason,
		Since: f.Since, Before: f.Before, Metadata: f.Metadata, MaxScan: f.MaxScan, MaxCount: f.MaxCount}
	if err := pf.Validate(); err != nil {
		return parked.Filter{}, err
	}
	if pf.Consumer == "" {
		return parked.Filter{}, fmt.Errorf("%w: ParkedFilter.Consumer is required: the Redis store keeps parked keys per consumer", inbox.ErrInvalidFilter)
	}
	return pf, nil
}

// FindParked returns a page of the consumer's parked messages that match
// f (f.Consumer is required), oldest parked first; ParkedPage.Next reads
// the next one. Every page costs a read of the record of each of the
// consumer's parked keys (without payloads), 1000 per round trip: the
// cost grows with the consumer's parked keys, whatever the filter. Released keys whose message is kept are listed
// with their status, as in inbox.Store.FindParked.
func (s *Store) FindParked(ctx context.Context, f inbox.ParkedFilter, p inbox.Page) (inbox.ParkedPage, error) {
	pf, err := filter(f)
	if err != nil {
		return inbox.ParkedPage{}, fmt.Errorf("redisstore: find parked: %w", err)
	}
	limit, err := parked.Limit(p.Limit)
	if err != nil {
		return inbox.ParkedPage{}, fmt.Errorf("redisstore: find parked: %w", err)
	}
	after, err := parked.Decode(p.After)
	if err != nil {
		return inbox.ParkedPage{}, fmt.Errorf("redisstore: find parked: %w", err)
	}
	all, err := s.scanParked(ctx, pf)
	if err != nil {
		return inbox.ParkedPage{}, fmt.Errorf("redisstore: find parked of %q: %w", pf.Consumer, err)
	}
	if after != nil {
		i := 0
		for i < len(all) && !after.Precedes(all[i].msg.ParkedAt, all[i].msg.Consumer, all[i].msg.Key) {
			i++
		}
		all = all[i:]
	}
	var page inbox.ParkedPage
	if len(all) > limit {
		all = all[:limit]
		last := all[limit-1].msg
		page.Next = parked.Cursor{ParkedAt: last.ParkedAt, Consumer: last.Consumer, Key: last.Key}.Encode()
	}
	page.Messages = make([]inbox.ParkedMessage, len(all))
	for i, e := range all {
		page.Messages[i] = e.msg
	}
	if p.Payloads && len(all) > 0 {
		cmds := make([]*redis.StringCmd, len(all))
		_, _ = s.b.c.Pipelined(ctx, func(pl redis.Pipeliner) error {
			for i, e := range all {
				cmds[i] = pl.HGet(ctx, s.b.recordKey(pf.Consumer, e.msg.Key), "m_payload")
			}
			return nil
		})
		for i, c := range cmds {
			v, err := c.Result()
			switch {
			case err == nil:
				page.Messages[i].Payload = []byte(v)
			case !errors.Is(err, redis.Nil): // redis.Nil: not kept, or gone since
				return inbox.ParkedPage{}, fmt.Errorf("redisstore: find parked of %q: %w", pf.Consumer, err)
			}
		}
	}
	return page, nil
}

// CountParked counts the consumer's parked messages that match f
// (f.Consumer is required), reading the whole parked set.
func (s *Store) CountParked(ctx context.Context, f inbox.ParkedFilter) (int64, error) {
	pf, err := filter(f)
	if err != nil {
		return 0, fmt.Errorf("redisstore: count parked: %w", err)
	}
	all, err := s.scanParked(ctx, pf)
	if err != nil {
		return 0, fmt.Errorf("redisstore: count parked of %q: %w", pf.Consumer, err)
	}
	if pf.MaxCount > 0 && len(all) > pf.MaxCount {
		return 0, fmt.Errorf("redisstore: count parked of %q: %w", pf.Consumer, pf.CountTooBroad())
	}
	return int64(len(all)), nil
}

// CountParkedKeys counts the consumer's parked keys (status parked, with
// or without a message): the Redis store's figure of
// inbox.Store.Stats's Rows["parked"]. It reads the consumer's parked set
// and each member's status (O(parked keys)). The metrics package's
// WatchRedisStore exports it.
func (s *Store) CountParkedKeys(ctx context.Context, consumer string) (int64, error) {
	if consumer == "" {
		return 0, fmt.Errorf("redisstore: count parked keys: %w: empty consumer name", inbox.ErrInvalidFilter)
	}
	b := s.b
	members, err := b.c.ZRange(ctx, b.parkedKey(consumer), 0, -1).Result()
	if err != nil {
		return 0, fmt.Errorf("redisstore: count parked keys of %q: %w", consumer, err)
	}
	var n int64
	for start := 0; start < len(members); start += scanChunk {
		chunk := members[start:min(start+scanChunk, len(members))]
		cmds := make([]*redis.StringCmd, len(chunk))
		_, _ = b.c.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, k := range chunk {
				cmds[i] = p.HGet(ctx, b.recordKey(consumer, k), "status")
			}
			return nil
		})
		for _, c := range cmds {
			status, err := c.Result()
			if err != nil && !errors.Is(err, redis.Nil) { // redis.Nil: a stale member
				return 0, fmt.Errorf("redisstore: count parked keys of %q: %w", consumer, err)
			}
			if status == inboxdb.StatusParked {
				n++
			}
		}
	}
	return n, nil
}

// GetParked returns the parked message of (consumer, key) with its
// payload, or an error wrapping inbox.ErrNotParked. The payload is read
// whole: to show a message, GetParkedPrefix reads a bounded part of it.
func (s *Store) GetParked(ctx context.Context, consumer, key string) (inbox.ParkedMessage, error) {
	if err := parked.CheckKey(consumer, key); err != nil {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: get parked: %w", err)
	}
	m, err := s.b.c.HGetAll(ctx, s.b.recordKey(consumer, key)).Result()
	if err != nil {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: get parked %q for %q: %w", key, consumer, err)
	}
	if _, message := m["m_uuid"]; m["status"] == "" || !message {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: get parked: %w (consumer %q, key %q)", inbox.ErrNotParked, consumer, key)
	}
	payload, kept := m["m_payload"]
	out, err := readParked(consumer, key, func(f string) string { return m[f] }, kept)
	if err != nil {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: get parked: %w", err)
	}
	if kept {
		out.Payload = []byte(payload)
	}
	return out, nil
}

// GetParkedPrefix is GetParked with at most the first maxPayload bytes of
// the payload in Payload (PayloadSize is the whole payload's size: the
// payload is cut when it is larger); only that prefix is sent to the
// caller. Redis has no range read of a hash field: a script cuts the
// payload inside Redis (which copies the value there, for the script's
// duration). maxPayload is at least 0 (0 reads no payload).
func (s *Store) GetParkedPrefix(ctx context.Context, consumer, key string, maxPayload int) (inbox.ParkedMessage, error) {
	if err := parked.CheckKey(consumer, key); err != nil {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: get parked: %w", err)
	}
	if maxPayload < 0 {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: get parked: %w: the most bytes of the payload to read is %d: at least 0",
			inbox.ErrInvalidFilter, maxPayload)
	}
	args := make([]any, 0, 1+len(entryFields))
	args = append(args, maxPayload)
	for _, f := range entryFields {
		args = append(args, f)
	}
	v, err := getPrefixScript.Run(ctx, s.b.c, []string{s.b.recordKey(consumer, key)}, args...).Slice()
	if err != nil {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: get parked %q for %q: %w", key, consumer, err)
	}
	if len(v) != 3 {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: get parked %q for %q: the script answered %d values, not 3", key, consumer, len(v))
	}
	fields, _ := v[0].([]any)
	field := func(name string) string {
		if i, ok := entryIndex[name]; ok && i < len(fields) {
			s, _ := fields[i].(string)
			return s
		}
		return ""
	}
	if field("status") == "" || field("m_uuid") == "" {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: get parked: %w (consumer %q, key %q)", inbox.ErrNotParked, consumer, key)
	}
	kept, _ := v[1].(int64)
	out, err := readParked(consumer, key, field, kept == 1)
	if err != nil {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: get parked: %w", err)
	}
	if p, ok := v[2].(string); ok && kept == 1 {
		out.Payload = []byte(p)
	}
	return out, nil
}

// getPrefixScript: KEYS the record; ARGV the most bytes of the payload,
// then the fields to read. Returns the fields' values, 1 when the record
// holds a payload (m_payload) else 0, and the payload's first bytes (nil
// when it holds none).
var getPrefixScript = redis.NewScript(`
local fields = redis.call('HMGET', KEYS[1], unpack(ARGV, 2))
local n = tonumber(ARGV[1])
if redis.call('HEXISTS', KEYS[1], 'm_payload') == 0 then
	return {fields, 0, false}
end
if n == 0 then
	return {fields, 1, ''}
end
return {fields, 1, string.sub(redis.call('HGET', KEYS[1], 'm_payload'), 1, n)}
`)

// ReplayParked delivers the parked message of (consumer, key) again
// through pub, so that the consumer processes it once, in three steps:
//
//  1. One script checks that the record holds a message that can be
//     replayed, releases the key (parked → failed) and marks the message
//     as being replayed: a second replay, or a discard, is refused
//     meanwhile (inbox.ErrReplayInProgress).
//  2. pub publishes the message to its topic (opts.Topic to name another)
//     with its UUID, payload and metadata, with a context that ends after
//     Config.ReplayTimeout.
//  3. One script deletes the message and its mark (and the key from the
//     parked set); the released record expires after DoneTTL, as after
//     Release.
//
// When the publish fails, the mark is removed and the key parked again
// (unless a delivery took it meanwhile), and the publish's error is
// returned: nothing was replayed. Should the process stop between the
// steps, the key stays released with its message kept (listed with status
// failed); the mark lapses after Config.ReplayTimeout, and the message can
// then be replayed again: should the first publish have happened, the
// copy is a duplicate to the consumer's inbox, which runs the key once
// (within DoneTTL).
//
// pub must reach the broker the consumer reads from (the topic names its
// destination as the consumer's subscriber sees it: for RabbitMQ, the
// queue or routing key). It returns the message as published, or an
// error wrapping inbox.ErrNotParked (no message: replayed or discarded
// meanwhile) or inbox.ErrNotReplayable (nothing changed: see its
// reasons, and inbox.ErrReplayInProgress).
func (s *Store) ReplayParked(ctx context.Context, consumer, key string, pub message.Publisher, opts inbox.ReplayOptions) (inbox.ParkedMessage, error) {
	if err := checkReplay(consumer, key, pub, opts); err != nil {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: replay parked: %w", err)
	}
	g, err := s.expectMessage(ctx, consumer, key, opts.Expect)
	if err != nil {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: replay parked: %w", err)
	}
	m, err := s.replay(ctx, consumer, key, g, pub, opts)
	if err != nil {
		return inbox.ParkedMessage{}, fmt.Errorf("redisstore: replay parked: %w", err)
	}
	return m, nil
}

// ReplayParkedMatching replays (as ReplayParked) the consumer's parked
// messages that match f (f.Consumer is required), oldest parked first,
// one at a time (opts.BatchSize does not apply). Messages that cannot be
// replayed, or that another operator replays or discards meanwhile, or
// that were parked again since the search (they may no longer match f),
// are skipped and counted. It stops at the first publish that fails (that
// message is parked again) and returns what it did with the error, also
// at ctx's end. An empty filter (but the consumer) is refused unless
// opts.All. Count first (CountParked), and confirm.
func (s *Store) ReplayParkedMatching(ctx context.Context, f inbox.ParkedFilter, pub message.Publisher, opts inbox.ReplayOptions) (inbox.ReplayReport, error) {
	var rep inbox.ReplayReport
	pf, err := bulkFilter(f, opts.All, "ReplayOptions", opts.BatchSize)
	if err == nil {
		err = checkPublisher(pub, opts)
	}
	if err == nil && !parked.Expect(opts.Expect).Empty() {
		err = fmt.Errorf("%w: ReplayOptions.Expect is for ReplayParked (one message), not a bulk replay", inbox.ErrInvalidFilter)
	}
	if err != nil {
		return rep, fmt.Errorf("redisstore: replay parked: %w", err)
	}
	all, err := s.scanParked(ctx, pf)
	if err != nil {
		return rep, fmt.Errorf("redisstore: replay parked of %q: %w", pf.Consumer, err)
	}
	for _, e := range all {
		if err := ctx.Err(); err != nil {
			return rep, fmt.Errorf("redisstore: replay parked: %w", err)
		}
		_, err := s.replay(ctx, pf.Consumer, e.msg.Key, parkGuard(e.parkedAtMS), pub, opts)
		switch {
		case err == nil:
			rep.Replayed++
		case errors.Is(err, inbox.ErrNotParked), errors.Is(err, inbox.ErrNotReplayable), errors.Is(err, inbox.ErrChanged):
			rep.Skipped++
		default:
			return rep, fmt.Errorf("redisstore: replay parked: %w", err)
		}
	}
	return rep, nil
}

// DiscardParked deletes the parked message of (consumer, key). A parked
// key becomes discarded (no longer parked; a late redelivery is
// acknowledged without running, as a duplicate; the record expires after
// DoneTTL as a done one does) unless opts.Forget, which deletes its record
// too, in the same step (the next delivery runs). A released key's record
// expires after DoneTTL. It returns an error wrapping inbox.ErrNotParked
// when there is no message, inbox.ErrReplayInProgress, or
// inbox.ErrChanged when opts.Expect no longer holds; nothing changed then.
func (s *Store) DiscardParked(ctx context.Context, consumer, key string, opts inbox.DiscardOptions) error {
	if err := parked.CheckKey(consumer, key); err != nil {
		return fmt.Errorf("redisstore: discard parked: %w", err)
	}
	g, err := s.expectMessage(ctx, consumer, key, opts.Expect)
	if err != nil {
		return fmt.Errorf("redisstore: discard parked: %w", err)
	}
	if err := s.discard(ctx, consumer, key, g, opts); err != nil {
		return fmt.Errorf("redisstore: discard parked: %w", err)
	}
	return nil
}

// DiscardParkedMatching deletes (as DiscardParked) the consumer's parked
// messages that match f (f.Consumer is required), skipping those being
// replayed or parked again since the search, and returns the number deleted, also when it stops early (an
// error, or ctx's end). An empty filter (but the consumer) is refused
// unless opts.All. Count first (CountParked), and confirm.
func (s *Store) DiscardParkedMatching(ctx context.Context, f inbox.ParkedFilter, opts inbox.DiscardOptions) (int64, error) {
	pf, err := bulkFilter(f, opts.All, "DiscardOptions", opts.BatchSize)
	if err == nil && !parked.Expect(opts.Expect).Empty() {
		err = fmt.Errorf("%w: DiscardOptions.Expect is for DiscardParked (one message), not a bulk discard", inbox.ErrInvalidFilter)
	}
	if err != nil {
		return 0, fmt.Errorf("redisstore: discard parked: %w", err)
	}
	all, err := s.scanParked(ctx, pf)
	if err != nil {
		return 0, fmt.Errorf("redisstore: discard parked of %q: %w", pf.Consumer, err)
	}
	var n int64
	for _, e := range all {
		if err := ctx.Err(); err != nil {
			return n, fmt.Errorf("redisstore: discard parked: %w", err)
		}
		err := s.discard(ctx, pf.Consumer, e.msg.Key, parkGuard(e.parkedAtMS), opts)
		switch {
		case err == nil:
			n++
		case errors.Is(err, inbox.ErrNotParked), errors.Is(err, inbox.ErrReplayInProgress), errors.Is(err, inbox.ErrChanged):
		default:
			return n, fmt.Errorf("redisstore: discard parked: %w", err)
		}
	}
	return n, nil
}

func checkReplay(consumer, key string, pub message.Publisher, opts inbox.ReplayOptions) error {
	if err := parked.CheckKey(consumer, key); err != nil {
		return err
	}
	return checkPublisher(pub, opts)
}

func checkPublisher(pub message.Publisher, opts inbox.ReplayOptions) error {
	if pub == nil {
		return fmt.Errorf("%w: nil publisher: pass the publisher of the broker the consumer reads from", inbox.ErrInvalidFilter)
	}
	if err := pgtext.Check(opts.Topic); err != nil {
		return fmt.Errorf("%w: ReplayOptions.Topic: %w", inbox.ErrInvalidFilter, err)
	}
	return nil
}

// bulkFilter checks the filter and options of a bulk operation.
func bulkFilter(f inbox.ParkedFilter, all bool, opts string, batchSize int) (parked.Filter, error) {
	pf, err := filter(f)
	if err != nil {
		return parked.Filter{}, err
	}
	rest := pf
	rest.Consumer = ""
	if rest.Empty() && !all {
		return parked.Filter{}, fmt.Errorf("%w: the filter selects every parked message of %q, and %s.All is not set", inbox.ErrInvalidFilter, pf.Consumer, opts)
	}
	if _, err := parked.Batch(opts+".BatchSize", batchSize); err != nil {
		return parked.Filter{}, err
	}
	pf.MaxScan, pf.MaxCount = 0, 0 // the bounds of finds and counts: a bulk operation acts on every match
	return pf, nil
}

// replay runs the three steps of ReplayParked.
// A bulk operation passes the park it found (parkGuard): a message parked
// again since (it may no longer match the filter) is then skipped, as the
// PostgreSQL store re-checks the filter under its lock; an operator's
// Expect passes the key as it was checked (expectMessage); nil takes the
// message whatever its park.
func (s *Store) replay(ctx context.Context, consumer, key string, g guard, pub message.Publisher, opts inbox.ReplayOptions) (inbox.ParkedMessage, error) {
	b := s.b
	token := watermill.NewUUID()
	override := "0"
	if opts.Topic != "" {
		override = "1"
	}
	res, err := beginReplayScript.Run(ctx, b.c, b.keys(consumer, key), append([]any{key, token, ms(s.replayTimeout), override}, g...)...).StringSlice()
	if err != nil {
		return inbox.ParkedMessage{}, fmt.Errorf("%q for %q: %w", key, consumer, err)
	}
	if len(res) == 0 {
		return inbox.ParkedMessage{}, fmt.Errorf("%q for %q: unexpected reply %v", key, consumer, res)
	}
	refuse := func(why string, also ...error) error {
		err := fmt.Errorf("%w: %q for %q: %s", inbox.ErrNotReplayable, key, consumer, why)
		for _, e := range also {
			err = fmt.Errorf("%w (%w)", err, e)
		}
		return err
	}
	switch res[0] {
	case "ok":
	case "gone":
		return inbox.ParkedMessage{}, fmt.Errorf("%w (consumer %q, key %q)", inbox.ErrNotParked, consumer, key)
	case "changed":
		return inbox.ParkedMessage{}, changedMeanwhile(consumer, key)
	case "replaying":
		until, _ := strconv.ParseInt(res[1], 10, 64)
		return inbox.ParkedMessage{}, refuse("another replay holds it until "+fromMS(until).UTC().Format(time.RFC3339)+": try again then", inbox.ErrReplayInProgress)
	case "not_kept":
		return inbox.ParkedMessage{}, refuse("its payload (" + res[1] + " bytes) was over the size the middleware keeps: re-publish it from its source, then Release the key")
	case "no_topic":
		return inbox.ParkedMessage{}, refuse("the topic it was consumed from is unknown: name one (ReplayOptions.Topic)")
	case inboxdb.StatusDone:
		return inbox.ParkedMessage{}, refuse("its key was processed since it was parked (released, then delivered again): a replay would be a duplicate; discard it")
	case inboxdb.StatusProcessing:
		return inbox.ParkedMessage{}, refuse("its key is being processed (an attempt holds its lease): try again once the attempt ends")
	default:
		return inbox.ParkedMessage{}, fmt.Errorf("%q for %q: unexpected reply %v", key, consumer, res)
	}
	if len(res) != 10 {
		return inbox.ParkedMessage{}, fmt.Errorf("%q for %q: unexpected reply %v", key, consumer, res)
	}
	num := func(i int) int64 { n, _ := strconv.ParseInt(res[i], 10, 64); return n }
	m := inbox.ParkedMessage{Consumer: consumer, Key: key, UUID: res[1], Topic: res[2], Payload: []byte(res[3]), PayloadSize: len(res[3]),
		PayloadKept: true, Metadata: map[string]string{}, Status: res[5], Reason: res[6], Attempts: int(num(7)),
		FirstSeenAt: fromMS(num(8)), ParkedAt: fromMS(num(9))}
	if opts.Topic != "" {
		m.Topic = opts.Topic
	}
	// From here on the key is released and the message marked: whatever
	// happens to ctx, the last step must run (bounded on its own).
	finish := func(script *redis.Script, args ...any) (int64, error) {
		c, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		return script.Run(c, b.c, b.keys(consumer, key), append([]any{key, token}, args...)...).Int64()
	}
	if res[4] != "" {
		if err := json.Unmarshal([]byte(res[4]), &m.Metadata); err != nil {
			if _, aerr := finish(abortReplayScript); aerr != nil {
				err = errors.Join(err, fmt.Errorf("parking it again: %w", aerr))
			}
			return inbox.ParkedMessage{}, fmt.Errorf("%q for %q: metadata: %w", key, consumer, err)
		}
	}
	msg := message.NewMessage(m.UUID, m.Payload)
	msg.Metadata = maps.Clone(m.Metadata)
	pctx, cancel := context.WithTimeout(ctx, s.replayTimeout)
	defer cancel()
	msg.SetContext(trace.ContextWithSpanContext(pctx, trace.SpanContext{})) // the metadata as it was: no trace context added
	if err := publish(pctx, pub, m.Topic, msg); err != nil {
		err = fmt.Errorf("publishing %q for %q (message %s) to %q: %w", key, consumer, m.UUID, m.Topic, err)
		if _, aerr := finish(abortReplayScript); aerr != nil {
			return inbox.ParkedMessage{}, fmt.Errorf("%w, and parking it again failed: %w", err, aerr)
		}
		return inbox.ParkedMessage{}, fmt.Errorf("%w (parked again)", err)
	}
	if _, err := finish(finishReplayScript, ms(b.ttl)); err != nil {
		return inbox.ParkedMessage{}, fmt.Errorf("%q for %q: published, but its parked message could not be removed: %w", key, consumer, err)
	}
	return m, nil
}

// publish publishes msg to topic through pub, bounded by ctx when pub
// takes one (an outbox.BatchPublisher, as rabbitmq.Publisher is): a
// publish still waiting for its confirm when the replay's mark lapses
// would let a second replay publish the message again.
func publish(ctx context.Context, pub message.Publisher, topic string, msg *message.Message) error {
	if bp, ok := pub.(outbox.BatchPublisher); ok {
		errs := bp.PublishBatch(ctx, []msgid.TopicMessage{{Topic: topic, Message: msg}})
		if len(errs) != 1 {
			return fmt.Errorf("%T.PublishBatch returned %d outcomes for 1 message", pub, len(errs))
		}
		return errs[0]
	}
	return pub.Publish(topic, msg)
}

// discard runs the discard script.
func (s *Store) discard(ctx context.Context, consumer, key string, g guard, opts inbox.DiscardOptions) error {
	forget := "0"
	if opts.Forget {
		forget = "1"
	}
	n, err := discardScript.Run(ctx, s.b.c, s.b.keys(consumer, key), append([]any{key, forget, ms(s.b.ttl)}, g...)...).Int64()
	switch {
	case err != nil:
		return fmt.Errorf("%q for %q: %w", key, consumer, err)
	case n == guardFailed:
		return changedMeanwhile(consumer, key)
	case n == 0:
		return fmt.Errorf("%w (consumer %q, key %q)", inbox.ErrNotParked, consumer, key)
	case n < 0:
		return fmt.Errorf("%w: %q for %q: try again once it ends (at most Config.ReplayTimeout)", inbox.ErrReplayInProgress, key, consumer)
	}
	return nil
}
