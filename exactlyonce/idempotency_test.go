package exactlyonce_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// firstForm is the encoding's first form: "<consumer>:<key>", or
// "sha256:<hex>" of consumer, NUL, key when longer than 255 bytes. It is
// the key of every consumer without ':' that is not "sha256"; for any
// consumer it would be ambiguous.
func firstForm(consumer, key string) string {
	k := consumer + ":" + key
	if len(k) <= 255 {
		return k
	}
	sum := sha256.Sum256([]byte(consumer + "\x00" + key))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// tenantKey is the key KeyByTenant derives for a message of tenant t whose
// own key (UUID) is inner.
func tenantKey(t *testing.T, tenant, inner string) (string, bool) {
	t.Helper()
	msg := message.NewMessage(inner, nil)
	msg.Metadata.Set("tenant", tenant)
	k, err := exactlyonce.KeyByTenant("tenant", nil)(msg)
	return k, err == nil
}

// TestIdempotencyKeyCollidingPairs: pairs of (consumer, key) that the
// first form alone would give one idempotency key get two; the keys of
// consumers without ':' (other than "sha256") are the first form, byte for
// byte.
func TestIdempotencyKeyCollidingPairs(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("x", 300)
	hashedHex := strings.TrimPrefix(firstForm("c", long), "sha256:")
	vip42, ok := tenantKey(t, "vip", "42")
	require.True(t, ok)
	for _, p := range []struct{ a, b [2]string }{
		{[2]string{"notify", vip42}, [2]string{"notify:vip", "42"}}, // KeyByTenant's key
		{[2]string{"a", "b:c:d"}, [2]string{"a:b", "c:d"}},
		{[2]string{"a", "b:c:d"}, [2]string{"a:b:c", "d"}},
		{[2]string{"a:b", "c:d"}, [2]string{"a:b:c", "d"}},
		{[2]string{"c", long}, [2]string{"sha256", hashedHex}}, // the hashed form
		{[2]string{"sha256", "x:y"}, [2]string{"sha256:x", "y"}},
	} {
		a := exactlyonce.IdempotencyKey(p.a[0], p.a[1])
		b := exactlyonce.IdempotencyKey(p.b[0], p.b[1])
		require.Equal(t, firstForm(p.a[0], p.a[1]), firstForm(p.b[0], p.b[1]), "%q and %q share the first form", p.a, p.b)
		require.NotEqual(t, a, b, "%q and %q must not share an idempotency key", p.a, p.b)
	}

	// The first form for the consumers that cannot collide.
	for _, p := range [][2]string{{"sms", "k1"}, {"notify", vip42}, {"c", long}, {"sha256x", "k"}, {"Sha256", "k"}} {
		require.Equal(t, firstForm(p[0], p[1]), exactlyonce.IdempotencyKey(p[0], p[1]), "%q", p)
	}
	// The form of the others: ":" <length of consumer> ":" consumer ":"
	// key, or ":sha256:" and the hex SHA-256 of that when over 255 bytes.
	require.Equal(t, ":10:notify:vip:42", exactlyonce.IdempotencyKey("notify:vip", "42"))
	require.Equal(t, ":6:sha256:"+hashedHex, exactlyonce.IdempotencyKey("sha256", hashedHex))
	sum := sha256.Sum256([]byte(":3:a:b:" + long))
	require.Equal(t, ":sha256:"+hex.EncodeToString(sum[:]), exactlyonce.IdempotencyKey("a:b", long))
}

// validPair reports whether the middleware accepts (consumer, key) (see
// Store.ValidateKey; 2048 is the largest MaxKeyLength).
func validPair(consumer, key string) bool {
	ok := func(s string) bool { return s != "" && utf8.ValidString(s) && !strings.Contains(s, "\x00") }
	return ok(consumer) && ok(key) && len(consumer) <= 255 && len(key) <= 2048
}

// FuzzIdempotencyKey: f(a) == f(b) implies a == b, over the pairs given
// and those built to collide under the first form alone: every other split
// of "<consumer>:<key>" at a ':', the tenant-scoped keys of KeyByTenant with
// the tenant moved into the consumer, and consumer "sha256" with the hex of
// a hashed key. Keys of consumers without ':' (other than "sha256") are
// the first form; every key fits in 255 bytes.
func FuzzIdempotencyKey(f *testing.F) {
	f.Add("notify", "vip:42", "notify:vip", "42", "vip")
	f.Add("a", "b:c:d", "a:b:c", "d", "t")
	f.Add("sha256", "x", "c", strings.Repeat("y", 300), "sha256")
	f.Add(":1", "2:3", "1:2", ":3", "")
	f.Add("c:"+strings.Repeat("z", 250), "k", "c", strings.Repeat("z", 250)+":k", "z")
	f.Fuzz(func(t *testing.T, c1, k1, c2, k2, tenant string) {
		var pairs [][2]string
		add := func(c, k string) {
			if validPair(c, k) {
				pairs = append(pairs, [2]string{c, k})
			}
		}
		add(c1, k1)
		add(c2, k2)
		for _, p := range [][2]string{{c1, k1}, {c2, k2}} {
			joined := p[0] + ":" + p[1]
			for i := range len(joined) {
				if joined[i] == ':' {
					add(joined[:i], joined[i+1:])
				}
			}
			if first := firstForm(p[0], p[1]); strings.HasPrefix(first, "sha256:") {
				add("sha256", strings.TrimPrefix(first, "sha256:"))
			}
			if k, ok := tenantKey(t, tenant, p[1]); ok {
				add(p[0], k)
				add(p[0]+":"+tenant, p[1])
			}
		}
		keys := make([]string, len(pairs))
		for i, p := range pairs {
			keys[i] = exactlyonce.IdempotencyKey(p[0], p[1])
			require.LessOrEqual(t, len(keys[i]), 255, "%q", p)
			if !strings.Contains(p[0], ":") && p[0] != "sha256" {
				require.Equal(t, firstForm(p[0], p[1]), keys[i], "%q: the first form", p)
			}
		}
		for i := range pairs {
			for j := range i {
				if keys[i] == keys[j] {
					require.Equal(t, pairs[j], pairs[i], "two pairs share the idempotency key %q", keys[i])
				}
			}
		}
	})
}

// TestIdempotencyKeyAcrossConsumers: consumer "notify" keying by tenant
// (KeyByTenant: "vip:42") and consumer "notify:vip" keying by UUID ("42")
// are two records, and their handlers get two idempotency keys, in every
// mode.
func TestIdempotencyKeyAcrossConsumers(t *testing.T) {
	t.Parallel()
	run := func(t *testing.T, cfg exactlyonce.Config, consumer string, byTenant bool) exactlyonce.Info {
		t.Helper()
		cfg.Consumer, cfg.NackDelay, cfg.Logger = consumer, -1, testenv.Logger(t)
		if byTenant {
			cfg.Key = exactlyonce.KeyByTenant("tenant", nil)
		}
		eo, err := exactlyonce.New(cfg)
		require.NoError(t, err)
		var info exactlyonce.Info
		msg := message.NewMessage("42", nil)
		msg.Metadata.Set("tenant", "vip")
		_, err = eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
			info, err = exactlyonce.InfoFromContext(msg.Context())
			return nil, err
		})(msg)
		require.NoError(t, err)
		return info
	}
	check := func(t *testing.T, cfg func() exactlyonce.Config) {
		t.Helper()
		byTenant := run(t, cfg(), "notify", true)
		byConsumer := run(t, cfg(), "notify:vip", false)
		require.Equal(t, "notify:vip:42", byTenant.IdempotencyKey, "a consumer without ':': the first form")
		require.Equal(t, ":10:notify:vip:42", byConsumer.IdempotencyKey)
	}
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		t.Run("transactional", func(t *testing.T) { check(t, func() exactlyonce.Config { return exactlyonce.Config{DB: b.DB} }) })
		t.Run("group commit", func(t *testing.T) {
			db := testenv.NewBundle(t, b.Driver).DB
			check(t, func() exactlyonce.Config {
				return exactlyonce.Config{DB: db, Batch: &exactlyonce.BatchConfig{MaxSize: 1}}
			})
		})
	})
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		check(t, func() exactlyonce.Config {
			cfg := exactlyonce.Config{Lease: &exactlyonce.LeaseConfig{Duration: 5 * time.Second}}
			s.with(&cfg)
			return cfg
		})
	})
}

// TestIdempotencyKeyStableAcrossAttempts: in lease mode the key of a record
// is the same on every attempt: after a failed one, and after one whose
// worker stopped mid-attempt (interrupted).
func TestIdempotencyKeyStableAcrossAttempts(t *testing.T) {
	t.Parallel()
	const consumer = "notify:vip"
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		ctx := context.Background()
		var r recorder
		fails := map[string]int{"new": 1, "stopped": 1}
		r.result = func(msg *message.Message) error {
			if fails[msg.UUID] > 0 {
				fails[msg.UUID]--
				return errors.New("provider said 503")
			}
			return nil
		}
		h := s.middleware(t, exactlyonce.Config{Consumer: consumer}).Middleware(r.handle)

		// Attempt 1 fails, attempt 2 succeeds.
		require.Error(t, deliverKey(h, "new"))
		require.NoError(t, deliverKey(h, "new"))
		runs := r.runs()
		require.Len(t, runs, 2)
		require.Equal(t, []int{1, 2}, []int{runs[0].Attempt, runs[1].Attempt})
		require.Equal(t, ":10:notify:vip:new", runs[0].IdempotencyKey)
		require.Equal(t, runs[0].IdempotencyKey, runs[1].IdempotencyKey)

		// Claimed by another worker, which stopped mid-attempt: the next
		// attempts are interrupted ones, with the same key.
		c, err := s.backend.Claim(ctx, consumer, "stopped", leasestore.Options{Lease: time.Minute})
		require.NoError(t, err)
		require.Equal(t, leasestore.Acquired, c.Outcome)
		s.expireOf(t, consumer, "stopped")
		require.Error(t, deliverKey(h, "stopped"))
		require.NoError(t, deliverKey(h, "stopped"))
		runs = r.runs()[2:]
		require.Len(t, runs, 2)
		require.Equal(t, []int{2, 3}, []int{runs[0].Attempt, runs[1].Attempt})
		require.True(t, runs[0].Interrupted)
		require.Equal(t, ":10:notify:vip:stopped", runs[0].IdempotencyKey)
		require.Equal(t, runs[0].IdempotencyKey, runs[1].IdempotencyKey)
	})
}

// TestIdempotencyKeyStableAcrossRelease: in transactional mode a record
// outlives its attempt only when the handler parked it (Permanent) and an
// operator released it; the attempt after the release gets the key of the
// attempt that parked it. Through every claim path (pgx's one-round-trip
// claim, database/sql's, group commit's).
func TestIdempotencyKeyStableAcrossRelease(t *testing.T) {
	t.Parallel()
	const consumer = "notify:vip"
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		store, err := inboxdb.NewStore(inboxdb.Config{Tables: b.DB})
		require.NoError(t, err)
		for _, batch := range []*exactlyonce.BatchConfig{nil, {MaxSize: 1}} {
			var r recorder
			permanent := map[string]bool{"new": true}
			r.result = func(msg *message.Message) error {
				if permanent[msg.UUID] {
					delete(permanent, msg.UUID)
					return exactlyonce.Permanent(errors.New("invalid phone number"))
				}
				return nil
			}
			cons := consumer
			if batch != nil {
				cons += ":batch"
			}
			eo, err := exactlyonce.New(exactlyonce.Config{DB: b.DB, Consumer: cons, Batch: batch, NackDelay: -1, Logger: testenv.Logger(t)})
			require.NoError(t, err)
			h := eo.Middleware(r.handle)

			require.NoError(t, deliverKey(h, "new"), "parked, acked")
			released, err := store.Release(b.Ctx, b.DB.Conn, cons, "new")
			require.NoError(t, err)
			require.True(t, released)
			require.NoError(t, deliverKey(h, "new"))
			runs := r.runs()
			require.Len(t, runs, 2)
			want := exactlyonce.IdempotencyKey(cons, "new")
			require.True(t, strings.HasPrefix(want, ":"), want)
			require.Equal(t, want, runs[0].IdempotencyKey)
			require.Equal(t, want, runs[1].IdempotencyKey, "after the release: the key of the attempt that parked it")
		}
	})
}

// TestIdempotencyKeyNeedsAConsumer: the encoding's proof needs a consumer
// that is not empty. An empty one (no Config.Consumer, no router handler
// name) is refused before any mode runs the handler, also a fail-open run,
// which computes the key without a record.
func TestIdempotencyKeyNeedsAConsumer(t *testing.T) {
	t.Parallel()
	for _, cfg := range []exactlyonce.Config{
		{FailOpen: true},
		{Batch: &exactlyonce.BatchConfig{MaxSize: 1}},
		{Lease: &exactlyonce.LeaseConfig{}},
	} {
		db := &fuzzDB{}
		cfg.DB, cfg.NackDelay, cfg.Logger = sqlschema.DB{Conn: db}, -1, testenv.Logger(t)
		eo, err := exactlyonce.New(cfg)
		require.NoError(t, err)
		ran := false
		_, err = eo.Middleware(func(*message.Message) ([]*message.Message, error) {
			ran = true
			return nil, nil
		})(message.NewMessage("42", nil))
		require.ErrorIs(t, err, exactlyonce.ErrInvalidKey)
		require.ErrorIs(t, err, inboxdb.ErrEmptyConsumer)
		require.False(t, ran)
		require.Zero(t, db.begins.Load())
	}
}
