// Package redisstore keeps lease mode's records in Redis instead of the
// PostgreSQL inbox table, for handlers whose only effect is external (an
// SMS, an e-mail, a call to another team's API) and whose teams run Redis,
// not PostgreSQL, next to the consumer:
//
//	store, err := redisstore.New(redisstore.Config{Client: rdb, DoneTTL: 7 * 24 * time.Hour})
//	eo, err := exactlyonce.New(exactlyonce.Config{
//		Lease: &exactlyonce.LeaseConfig{Duration: 30 * time.Second, Store: store},
//	})
//
// The lease-mode contract is the PostgreSQL store's: a claim with a lease
// and a fencing token, committed before the handler runs; extension,
// completion and failure only by the holder of the token (each one Lua
// script, atomic on the server); interrupted attempts retried with the same
// idempotency key up to MaxInterruptedAttempts, then parked; Permanent
// errors parked, with the message they were parked with (its payload up to
// exactlyonce.Config.MaxParkedPayload); parked keys listed and released
// (Store.Parked, Store.Release). The middleware's lease-mode behaviour suite runs against
// both stores.
//
// A parked key keeps the message it was parked with, in its record: the
// operators' view finds it (Store.FindParked, CountParked, GetParked: by
// key, message UUID, tenant, reason, time, or a metadata field such as a
// business id; Redis has no index for these, so each find, count or bulk
// operation reads the record of every parked key of the consumer, without
// payloads, 1000 per round trip, and filters in Go: its cost grows with
// the consumer's parked keys, whatever the filter), replays it through a
// message.Publisher the operator passes (Store.ReplayParked: the key is
// released and the message published with its UUID, payload and
// metadata), or discards it (Store.DiscardParked), with inbox.Store's
// types and errors.
//
// What differs: the completion records only the done record. It cannot
// hold database writes or output messages, so exactlyonce.New refuses
// Config.DB, Batch, FailOpen and PublishTopic with this store, and a
// handler that asks for a transaction or an outbox, or returns messages, is
// not completed: its key is parked and the handler's later keys are
// refused before the handler runs (see exactlyonce.LeaseStore). Done records are kept for
// Config.DoneTTL, the deduplication window: a copy that arrives later runs
// again.
//
// The guarantee is only as durable as Redis: without an append-only file
// a restart forgets done records and leases, an eviction policy other than
// noeviction may evict them, and a failover may lose acknowledged writes.
// docs/redis.md states what each setting does and which ones keep it.
//
// Keys: <Prefix>{<consumer>}:k:<message key> is a key's record (a hash;
// once parked, it also holds the message it was parked with, written by
// the script that parks: see scripts.go), <Prefix>{<consumer>}:parked its
// consumer's parked keys and the released keys whose parked message is
// kept (a sorted set by first-seen time). The braces are a Redis Cluster hash tag: a consumer's
// records and its parked set share one slot, so that parking is atomic
// with the record, at the price of one consumer's keys living on one node.
// The package does not import the middleware; the middleware does not
// import Redis.
package redisstore

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/redis/go-redis/v9"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/internal/parked"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
)

// Config configures a Store.
type Config struct {
	// Client is the Redis client: *redis.Client (also a Sentinel failover
	// client) or *redis.ClusterClient (every script touches one hash slot).
	// The caller owns it (and closes it). Required.
	Client redis.UniversalClient

	// Prefix starts every key the store writes, so that several stores
	// (or applications) share a Redis. It must not contain '{' or '}'
	// (the hash tag that follows it). Defaults to "exactlyonce:".
	Prefix string

	// DoneTTL is how long a done record is kept: the deduplication window.
	// A copy of a message that arrives later than this after its
	// completion runs again. Choose it longer than the longest time your
	// broker may redeliver or a producer may re-send a message. Failed and
	// released records expire after it too (a later delivery then starts
	// again at attempt 1); processing and parked records never expire. At
	// least 1s. Defaults to 7 days.
	DoneTTL time.Duration

	// ReplayTimeout bounds a replay of a parked message (ReplayParked):
	// its publish runs with a context that ends then (PublishBatch's, when
	// the publisher is an outbox.BatchPublisher as rabbitmq.Publisher is;
	// else the message's context, which a publisher may ignore: keep
	// ReplayTimeout above that publisher's own timeout), and while it runs a
	// second replay or a discard of the message is refused
	// (inbox.ErrReplayInProgress). Should the replaying process stop between
	// the release and the end of the replay, the key stays released with
	// its message kept, and the message can be replayed (or discarded)
	// again once ReplayTimeout has passed. At least 1s. Defaults to 1
	// minute.
	ReplayTimeout time.Duration
}

const (
	defaultPrefix        = "exactlyonce:"
	defaultDoneTTL       = 7 * 24 * time.Hour
	defaultReplayTimeout = time.Minute
)

// WithDefaults returns a copy of c with empty fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Prefix == "" {
		c.Prefix = defaultPrefix
	}
	if c.DoneTTL == 0 {
		c.DoneTTL = defaultDoneTTL
	}
	if c.ReplayTimeout == 0 {
		c.ReplayTimeout = defaultReplayTimeout
	}
	return c
}

func (c Config) validate() error {
	if c.Client == nil {
		return errors.New("redisstore: Config.Client is required (redis.NewClient(&redis.Options{...}))")
	}
	if strings.ContainsAny(c.Prefix, "{}") {
		return fmt.Errorf("redisstore: Config.Prefix %q must not contain '{' or '}': they would move the Redis Cluster hash tag", c.Prefix)
	}
	if c.DoneTTL < time.Second {
		return fmt.Errorf("redisstore: Config.DoneTTL is %s, it must be at least 1s", c.DoneTTL)
	}
	if c.ReplayTimeout < time.Second {
		return fmt.Errorf("redisstore: Config.ReplayTimeout is %s, it must be at least 1s", c.ReplayTimeout)
	}
	return nil
}

// Store is a Redis lease-mode store. Give it to
// exactlyonce.LeaseConfig.Store; its methods are the operators' view (the
// equivalent of inbox.Store for the PostgreSQL store). Safe for concurrent
// use.
type Store struct {
	leaseHandle   // provides b to the middleware (exactlyonce.LeaseStore)
	b             *backend
	replayTimeout time.Duration
}

// leaseHandle names leasestore.Handle for Store to embed it unexported.
type leaseHandle = leasestore.Handle

// A Store is an exactlyonce.LeaseStore.
var _ leasestore.Provider = (*Store)(nil)

// New checks cfg and returns a Store. It does not contact Redis.
func New(cfg Config) (*Store, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	b := &backend{c: cfg.Client, prefix: cfg.Prefix, ttl: cfg.DoneTTL}
	return &Store{leaseHandle: leasestore.NewHandle(b), b: b, replayTimeout: cfg.ReplayTimeout}, nil
}

// Get returns the record of (consumer, key), or an error wrapping
// inbox.ErrNotFound (also once a done record's DoneTTL has passed).
func (s *Store) Get(ctx context.Context, consumer, key string) (inbox.Record, error) {
	r, err := s.b.Get(ctx, consumer, key)
	if err != nil {
		return inbox.Record{}, fmt.Errorf("redisstore: get: %w", err)
	}
	return record(r), nil
}

// Forget deletes the record of (consumer, key), with its parked message
// if it has one, so that the next delivery runs the handler again. It
// reports whether a record existed.
//
// With an Expect (the record's Version, Status or parked MessageUUID that
// was shown), it forgets only while the key is still so, and otherwise
// returns an error wrapping inbox.ErrChanged (a key with no record:
// inbox.ErrNotFound), having changed nothing.
func (s *Store) Forget(ctx context.Context, consumer, key string, expect inbox.Expect) (bool, error) {
	g, err := s.expectRecord(ctx, consumer, key, expect)
	if err != nil {
		return false, fmt.Errorf("redisstore: forget: %w", err)
	}
	ok, err := s.b.forget(ctx, consumer, key, g)
	if err != nil {
		return false, fmt.Errorf("redisstore: forget: %w", err)
	}
	return ok, nil
}

// Parked returns up to limit parked records of consumer (required: the
// parked keys are kept per consumer), oldest first; limit <= 0 means 100.
// It reads the consumer's parked set and each record: O(log n + limit).
func (s *Store) Parked(ctx context.Context, consumer string, limit int) ([]inbox.Record, error) {
	rs, err := s.b.Parked(ctx, consumer, limit)
	if err != nil {
		return nil, fmt.Errorf("redisstore: parked: %w", err)
	}
	out := make([]inbox.Record, len(rs))
	for i, r := range rs {
		out[i] = record(r)
	}
	return out, nil
}

// Release turns a parked key into failed, so that its next delivery runs
// again (attempts+1, the same idempotency key, Interrupted when the parked
// attempt was). It reports whether a parked record was found. The broker
// acked the parked message: the next delivery is a re-publish or a later
// duplicate, which must come within DoneTTL (the released record expires
// then, and a delivery after that starts again at attempt 1).
// ReplayParked releases the key and re-publishes its message in one call.
//
// Release keeps the key's parked message: it stays listed (FindParked,
// with the key's status) and its record does not expire until the message
// is replayed or discarded, or the key forgotten. Once a delivery takes
// the key (the record's lifecycle goes on: processing, then done or
// failed, which expire after DoneTTL), the message goes with the record.
//
// With an Expect (the record's Version that was shown, say), it releases
// only while the key is still so, and otherwise returns an error wrapping
// inbox.ErrChanged (a key with no record: inbox.ErrNotFound), having
// changed nothing.
func (s *Store) Release(ctx context.Context, consumer, key string, expect inbox.Expect) (bool, error) {
	g, err := s.expectRecord(ctx, consumer, key, expect)
	if err != nil {
		return false, fmt.Errorf("redisstore: release: %w", err)
	}
	ok, err := s.b.release(ctx, consumer, key, g)
	if err != nil {
		return false, fmt.Errorf("redisstore: release: %w", err)
	}
	return ok, nil
}

func record(r inboxdb.Record) inbox.Record {
	return inbox.Record{Consumer: r.Consumer, Key: r.Key, Status: r.Status, Attempts: r.Attempts, Duplicates: r.Duplicates,
		LeaseUntil: r.LeaseUntil, FirstSeenAt: r.FirstSeenAt, ProcessedAt: r.ProcessedAt, LastError: r.LastError,
		Interrupted: r.Interrupted, Interruptions: r.Interruptions,
		Version: parked.RecordVersion(r.Status, r.Attempts, r.FirstSeenAt, r.ProcessedAt)}
}

// backend implements leasestore.Backend.
type backend struct {
	c      redis.UniversalClient
	prefix string
	ttl    time.Duration
}

var (
	_ leasestore.Backend = (*backend)(nil)
	_ leasestore.Checker = (*backend)(nil)
)

// tag escapes a consumer name for the hash tag: '%', '{' and '}' are
// percent-encoded, so that the tag ends where the name ends and distinct
// names stay distinct.
func tag(consumer string) string {
	if !strings.ContainsAny(consumer, "%{}") {
		return consumer
	}
	return strings.NewReplacer("%", "%25", "{", "%7B", "}", "%7D").Replace(consumer)
}

func (b *backend) recordKey(consumer, key string) string {
	return b.prefix + "{" + tag(consumer) + "}:k:" + key
}

func (b *backend) parkedKey(consumer string) string {
	return b.prefix + "{" + tag(consumer) + "}:parked"
}

func (b *backend) keys(consumer, key string) []string {
	return []string{b.recordKey(consumer, key), b.parkedKey(consumer)}
}

func ms(d time.Duration) int64 { return d.Milliseconds() }

func fromMS(v int64) time.Time { return time.UnixMilli(v) }

func check(consumer, key string) error {
	switch {
	case consumer == "":
		return inboxdb.ErrEmptyConsumer
	case key == "":
		return inboxdb.ErrEmptyKey
	}
	return nil
}

// Claim runs the claim script (see leasestore.Backend for the rules).
func (b *backend) Claim(ctx context.Context, consumer, key string, opts leasestore.Options) (leasestore.Claim, error) {
	if err := check(consumer, key); err != nil {
		return leasestore.Claim{}, err
	}
	if opts.Lease <= 0 {
		return leasestore.Claim{}, fmt.Errorf("lease must be > 0, got %s", opts.Lease)
	}
	if opts.MaxInterrupted < 0 {
		return leasestore.Claim{}, fmt.Errorf("MaxInterrupted must be >= 0, got %d", opts.MaxInterrupted)
	}
	token := watermill.NewUUID() // random (version 4): every claim its own
	args := []any{token, ms(opts.Lease), opts.MaxInterrupted, key, "0"}
	if opts.Message != nil {
		args[4] = "?" // sent only to the claim that parks (see claimScript)
	}
	res, err := claimScript.Run(ctx, b.c, b.keys(consumer, key), args...).Slice()
	if err == nil && len(res) == 7 && res[0] == "message" {
		res, err = claimScript.Run(ctx, b.c, b.keys(consumer, key), append(args[:4:4], messageArgs(opts.Message)...)...).Slice()
	}
	if err != nil {
		return leasestore.Claim{}, fmt.Errorf("lease claim of %q for %q: %w", key, consumer, err)
	}
	if len(res) != 7 {
		return leasestore.Claim{}, fmt.Errorf("lease claim of %q for %q: unexpected reply %v", key, consumer, res)
	}
	outcome, _ := res[0].(string)
	attempts, _ := res[1].(int64)
	until, _ := res[2].(int64)
	interrupted, _ := res[3].(int64)
	parkedNow, _ := res[4].(int64)
	firstSeen, _ := res[5].(int64)
	lastErr, _ := res[6].(string)
	c := leasestore.Claim{Attempt: int(attempts), Interrupted: interrupted == 1, ParkedNow: parkedNow == 1}
	c.Record = leasestore.Record{Consumer: consumer, Key: key, Attempts: int(attempts), FirstSeenAt: fromMS(firstSeen), LastError: lastErr}
	switch outcome {
	case "acquired":
		c.Outcome, c.Token, c.LeaseUntil = leasestore.Acquired, token, fromMS(until)
		c.Record.Status, c.Record.LeaseUntil = inboxdb.StatusProcessing, &c.LeaseUntil
	case "duplicate":
		c.Outcome, c.Record.Status = leasestore.Duplicate, inboxdb.StatusDone
	case "parked":
		c.Outcome, c.Record.Status = leasestore.Parked, inboxdb.StatusParked
	case "busy":
		c.Outcome, c.LeaseUntil, c.Record.Status = leasestore.Busy, fromMS(until), inboxdb.StatusProcessing
		c.Record.LeaseUntil = &c.LeaseUntil
	default:
		return leasestore.Claim{}, fmt.Errorf("lease claim of %q for %q: unexpected outcome %q", key, consumer, outcome)
	}
	return c, nil
}

// messageArgs are the script arguments that keep msg with a park (see
// luaKeep): "0" alone for none.
func messageArgs(msg *inboxdb.ParkedMessage) []any {
	if msg == nil {
		return []any{"0", "", "", "0", "", 0, "{}"}
	}
	r := msg.Row()
	kept := "0"
	if r.Payload != nil {
		kept = "1"
	}
	return []any{"1", r.UUID, r.Topic, kept, r.Payload, r.PayloadSize, r.Metadata}
}

// fenced runs a script that answers -1 when the attempt no longer owns the
// key, and returns its reply otherwise.
func (b *backend) fenced(ctx context.Context, what string, a leasestore.Attempt, s *redis.Script, args ...any) (int64, error) {
	if a.Token == "" {
		return 0, fmt.Errorf("%w: %q for %q", leasestore.ErrLeaseLost, a.Key, a.Consumer)
	}
	n, err := s.Run(ctx, b.c, b.keys(a.Consumer, a.Key), append([]any{a.Token}, args...)...).Int64()
	if err != nil {
		return 0, fmt.Errorf("%s %q for %q: %w", what, a.Key, a.Consumer, err)
	}
	if n == -1 {
		return 0, fmt.Errorf("%w: %q for %q", leasestore.ErrLeaseLost, a.Key, a.Consumer)
	}
	return n, nil
}

// Extend moves the lease to now + d (a.Tx is ignored: there is none).
func (b *backend) Extend(ctx context.Context, a leasestore.Attempt, d time.Duration) (time.Time, error) {
	if d <= 0 {
		return time.Time{}, fmt.Errorf("lease must be > 0, got %s", d)
	}
	until, err := b.fenced(ctx, "extending lease of", a, extendScript, ms(d))
	if err != nil {
		return time.Time{}, err
	}
	return fromMS(until), nil
}

// Complete records done, with the DoneTTL, at once.
func (b *backend) Complete(ctx context.Context, a leasestore.Attempt) error {
	_, err := b.fenced(ctx, "completing", a, completeScript, ms(b.ttl))
	return err
}

// Owns reports whether the record is processing with a's token.
func (b *backend) Owns(ctx context.Context, a leasestore.Attempt) (bool, error) {
	v, err := b.c.HMGet(ctx, b.recordKey(a.Consumer, a.Key), "status", "token").Result()
	if err != nil {
		return false, fmt.Errorf("checking the lease of %q for %q: %w", a.Key, a.Consumer, err)
	}
	return v[0] == inboxdb.StatusProcessing && v[1] == a.Token, nil
}

// Fail records failed (expiring after DoneTTL) or parked, keeping
// a.Message with the park.
func (b *backend) Fail(ctx context.Context, a leasestore.Attempt, errText string, permanent bool) error {
	park := "0"
	if permanent {
		park = "1"
	}
	args := []any{pgtext.Truncate(errText), park, ms(b.ttl), a.Key}
	if permanent {
		args = append(args, messageArgs(a.Message)...)
	} else {
		args = append(args, messageArgs(nil)...)
	}
	_, err := b.fenced(ctx, "recording failure of", a, failScript, args...)
	return err
}

// ParkInterrupted parks the key, marked interrupted, keeping a.Message.
func (b *backend) ParkInterrupted(ctx context.Context, a leasestore.Attempt, reason string) error {
	_, err := b.fenced(ctx, "parking", a, parkInterruptedScript, append([]any{pgtext.Truncate(reason), a.Key}, messageArgs(a.Message)...)...)
	return err
}

// Get reads the record: its fields, not the message a park kept (whose
// payload can weigh megabytes).
func (b *backend) Get(ctx context.Context, consumer, key string) (leasestore.Record, error) {
	vals, err := b.c.HMGet(ctx, b.recordKey(consumer, key), recordFields...).Result()
	if err != nil {
		return leasestore.Record{}, fmt.Errorf("%q for %q: %w", key, consumer, err)
	}
	m := make(map[string]string, len(recordFields))
	for i, v := range vals {
		if s, ok := v.(string); ok {
			m[recordFields[i]] = s
		}
	}
	if m["status"] == "" {
		return leasestore.Record{}, fmt.Errorf("%q for %q: %w", key, consumer, inboxdb.ErrNotFound)
	}
	return parseRecord(consumer, key, m), nil
}

func parseRecord(consumer, key string, m map[string]string) leasestore.Record {
	num := func(f string) int64 {
		v, _ := strconv.ParseInt(m[f], 10, 64)
		return v
	}
	at := func(f string) *time.Time {
		if m[f] == "" {
			return nil
		}
		t := fromMS(num(f))
		return &t
	}
	return leasestore.Record{
		Consumer: consumer, Key: key, Status: m["status"], Attempts: int(num("attempts")), Duplicates: num("duplicates"),
		LeaseUntil: at("lease_until_ms"), FirstSeenAt: fromMS(num("first_seen_ms")), ProcessedAt: at("processed_at_ms"),
		LastError: m["last_error"], Interrupted: m["interrupted"] == "1", Interruptions: int(num("interruptions")),
	}
}

// Forget deletes the record (with the message its park kept) and its
// parked entry.
func (b *backend) Forget(ctx context.Context, consumer, key string) (bool, error) {
	return b.forget(ctx, consumer, key, nil)
}

// forget is Forget while the record's fields hold g (see guard).
func (b *backend) forget(ctx context.Context, consumer, key string, g guard) (bool, error) {
	n, err := forgetScript.Run(ctx, b.c, b.keys(consumer, key), append([]any{key}, g...)...).Int64()
	if err != nil {
		return false, fmt.Errorf("forgetting %q for %q: %w", key, consumer, err)
	}
	if n == guardFailed {
		return false, changedMeanwhile(consumer, key)
	}
	return n > 0, nil
}

// recordFields are the record fields parseRecord reads (not the message a
// park kept).
var recordFields = []string{"status", "attempts", "duplicates", "lease_until_ms", "first_seen_ms", "processed_at_ms",
	"last_error", "interrupted", "interruptions"}

// Parked reads the consumer's parked set, oldest first, then the records,
// until it has limit parked ones or the set's end: the set also holds
// released keys whose message is kept, which are not listed.
func (b *backend) Parked(ctx context.Context, consumer string, limit int) ([]leasestore.Record, error) {
	if consumer == "" {
		return nil, errors.New("listing parked keys: the consumer is required (the Redis store keeps parked keys per consumer)")
	}
	if limit <= 0 {
		limit = 100
	}
	window := int64(max(limit, 100))
	var out []leasestore.Record
	for start := int64(0); len(out) < limit; start += window {
		members, err := b.c.ZRange(ctx, b.parkedKey(consumer), start, start+window-1).Result()
		if err != nil {
			return nil, fmt.Errorf("listing parked keys of %q: %w", consumer, err)
		}
		if len(members) == 0 {
			break
		}
		cmds := make([]*redis.SliceCmd, len(members))
		_, err = b.c.Pipelined(ctx, func(p redis.Pipeliner) error {
			for i, k := range members {
				cmds[i] = p.HMGet(ctx, b.recordKey(consumer, k), recordFields...)
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("listing parked keys of %q: %w", consumer, err)
		}
		for i, k := range members {
			m := map[string]string{}
			for j, v := range cmds[i].Val() {
				if v, ok := v.(string); ok {
					m[recordFields[j]] = v
				}
			}
			r := parseRecord(consumer, k, m)
			// Released (a kept message holds it in the set) or forgotten
			// meanwhile: skip.
			if r.Status == inboxdb.StatusParked && len(out) < limit {
				out = append(out, r)
			}
		}
		if int64(len(members)) < window {
			break
		}
	}
	return out, nil
}

// Release turns a parked record into failed.
func (b *backend) Release(ctx context.Context, consumer, key string) (bool, error) {
	return b.release(ctx, consumer, key, nil)
}

// release is Release while the record's fields hold g (see guard).
func (b *backend) release(ctx context.Context, consumer, key string, g guard) (bool, error) {
	n, err := releaseScript.Run(ctx, b.c, b.keys(consumer, key), append([]any{key, ms(b.ttl)}, g...)...).Int64()
	if err != nil {
		return false, fmt.Errorf("releasing %q for %q: %w", key, consumer, err)
	}
	if n == guardFailed {
		return false, changedMeanwhile(consumer, key)
	}
	return n == 1, nil
}

// StartupCheck reads the server's persistence and eviction settings
// (CONFIG GET) and returns the ones that lose records (docs/redis.md): no
// append-only file, and an eviction policy other than noeviction.
func (b *backend) StartupCheck(ctx context.Context) ([]string, error) {
	get := func(name string) (string, error) {
		vals, err := b.c.ConfigGet(ctx, name).Result()
		if err != nil {
			return "", fmt.Errorf("redisstore: CONFIG GET %s: %w", name, err)
		}
		return vals[name], nil
	}
	aof, err := get("appendonly")
	if err != nil {
		return nil, err
	}
	policy, err := get("maxmemory-policy")
	if err != nil {
		return nil, err
	}
	var problems []string
	if aof != "yes" {
		problems = append(problems, "the Redis server runs without an append-only file (appendonly "+aof+"): a restart forgets done records, leases and parked keys, and their messages run again; set appendonly yes (docs/redis.md)")
	}
	if policy != "noeviction" {
		problems = append(problems, "the Redis server evicts keys when full (maxmemory-policy "+policy+"): evicted done records run again, evicted leases let two workers hold a key; set maxmemory-policy noeviction (docs/redis.md)")
	}
	return problems, nil
}

// CheckServer reports what in the Redis server's set-up weakens the
// guarantee: no append-only file (appendonly no), an eviction policy other
// than noeviction. The middleware runs it once at start-up and logs what
// it finds; call it yourself to fail a deployment on it. It returns an
// error when the server cannot be asked (CONFIG GET refused or Redis
// unreachable).
func (s *Store) CheckServer(ctx context.Context) ([]string, error) { return s.b.StartupCheck(ctx) }

// Unreachable reports whether err means Redis could not be reached or
// cannot serve at the moment: a network error or lost connection, no
// connection free in the pool in time, or a server loading its data,
// without a primary (MASTERDOWN, CLUSTERDOWN, TRYAGAIN), read-only (a
// replica after a failover) or busy with a script. A closed client, the
// message's context ending and any other error reply (an out-of-memory
// refusal included) are not.
func (b *backend) Unreachable(err error) bool {
	switch {
	case err == nil, errors.Is(err, redis.ErrClosed), errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return false
	case errors.Is(err, redis.ErrPoolTimeout), errors.Is(err, redis.ErrPoolExhausted),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF),
		errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return true
	case redis.IsLoadingError(err), redis.IsMasterDownError(err), redis.IsClusterDownError(err),
		redis.IsTryAgainError(err), redis.IsReadOnlyError(err), redis.IsMaxClientsError(err):
		return true
	}
	var re redis.Error
	if errors.As(err, &re) && strings.HasPrefix(re.Error(), "BUSY ") {
		return true
	}
	var ne net.Error
	return errors.As(err, &ne)
}

// Transactional is false: the completion is one script, with no room for
// the handler's writes or outputs.
func (b *backend) Transactional() bool { return false }
