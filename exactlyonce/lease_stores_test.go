package exactlyonce_test

// The lease-mode behaviour suite, run once per store (PostgreSQL, MariaDB,
// Redis): what a handler and an operator see must not depend on where the
// records live. Store-specific behaviour (the SQL completion transaction
// and outbox, Redis's DoneTTL and refusals) is tested elsewhere.

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// leaseStore is one lease-mode store under test.
type leaseStore struct {
	name string
	// backend is the store's implementation, for what another worker or
	// an operator does to a key.
	backend leasestore.Backend
	// with puts the store in cfg: Config.DB (PostgreSQL, MariaDB) or
	// Config.Lease.Store (Redis).
	with func(cfg *exactlyonce.Config)
	// expireOf ends the live lease of consumer's key now, as if its worker
	// had stopped long ago.
	expireOf func(t *testing.T, consumer, key string)
	// kept reads the message kept with the park of consumer's key (see
	// keptMessage); false when none.
	kept func(t *testing.T, consumer, key string) (keptMessage, bool)
	ev   testenv.Counters
}

// expire ends the live lease of suiteConsumer's key now.
func (s *leaseStore) expire(t *testing.T, key string) { s.expireOf(t, suiteConsumer, key) }

// suiteConsumer is the consumer name of the suite's middlewares.
const suiteConsumer = "sms"

func postgresLeaseStore(t *testing.T) *leaseStore {
	tables := testenv.Schema(t)
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
	require.NoError(t, err)
	return &leaseStore{
		name:    "postgres",
		backend: &leasestore.Postgres{Store: store, DB: tables.Conn},
		with:    func(cfg *exactlyonce.Config) { cfg.DB = tables },
		expireOf: func(t *testing.T, consumer, key string) {
			_, err := tables.Conn.ExecContext(context.Background(), "UPDATE "+tables.Inbox()+
				" SET lease_until = now() - interval '1 second' WHERE consumer = $1 AND message_key = $2 AND status = 'processing'", consumer, key)
			require.NoError(t, err)
		},
		kept: func(t *testing.T, consumer, key string) (keptMessage, bool) {
			return keptInPostgres(t, tables, consumer, key)
		},
	}
}

// mariadbLeaseStore is the inbox table on MariaDB (sqlschema.MySQL),
// through database/sql: the store lease mode uses when Config.DB is MySQL.
func mariadbLeaseStore(t *testing.T) *leaseStore {
	conn := wsql.BeginnerFromStdSQL(testenv.MySQLDB(t))
	tables := testenv.SchemaMySQL(t, conn)
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
	require.NoError(t, err)
	return &leaseStore{
		name:    testenv.MariaDB,
		backend: &leasestore.Postgres{Store: store, DB: conn},
		with:    func(cfg *exactlyonce.Config) { cfg.DB = tables },
		expireOf: func(t *testing.T, consumer, key string) {
			_, err := conn.ExecContext(context.Background(), "UPDATE "+tables.Inbox()+
				" SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND WHERE consumer = ? AND message_key = ? AND status = 'processing'", consumer, key)
			require.NoError(t, err)
		},
		kept: func(t *testing.T, consumer, key string) (keptMessage, bool) {
			return keptInMySQL(t, tables, consumer, key)
		},
	}
}

// keptInMySQL is keptInPostgres on MySQL/MariaDB: the parked message of
// (consumer, key) from the table of parked messages; false when there is
// none.
func keptInMySQL(t *testing.T, db sqlschema.DB, consumer, key string) (keptMessage, bool) {
	t.Helper()
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	require.NoError(t, err)
	var k keptMessage
	var meta string
	err = seam.QueryRow(context.Background(), db.Conn, `SELECT message_uuid, topic, coalesce(payload, ''), payload IS NOT NULL, payload_size,
metadata, reason, attempts FROM `+store.ParkedTable()+` WHERE consumer = ? AND message_key = ?`, []any{consumer, key},
		&k.UUID, &k.Topic, &k.Payload, &k.PayloadKept, &k.PayloadSize, &meta, &k.Reason, &k.Attempts)
	if errors.Is(err, seam.ErrNoRows) {
		return keptMessage{}, false
	}
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal([]byte(meta), &k.Metadata))
	return k, true
}

func redisLeaseStore(t *testing.T) *leaseStore {
	c := testenv.Redis(t)
	prefix := testenv.RedisPrefix(t, c)
	store, err := redisstore.New(redisstore.Config{Client: c, Prefix: prefix})
	require.NoError(t, err)
	return &leaseStore{
		name:    "redis",
		backend: leasestore.BackendOf(store),
		with:    func(cfg *exactlyonce.Config) { cfg.Lease.Store = store },
		expireOf: func(t *testing.T, consumer, key string) {
			// The record's layout is redisstore's (see its package doc).
			err := c.Eval(context.Background(), `if redis.call('HGET', KEYS[1], 'status') == 'processing' then
redis.call('HSET', KEYS[1], 'lease_until_ms', 1) end`, []string{prefix + "{" + consumer + "}:k:" + key}).Err()
			if err != nil && err.Error() != "redis: nil" {
				require.NoError(t, err)
			}
		},
		kept: func(t *testing.T, consumer, key string) (keptMessage, bool) {
			return keptInRedis(t, c, prefix, consumer, key)
		},
	}
}

// eachLeaseStore runs f once per store, in parallel subtests.
func eachLeaseStore(t *testing.T, f func(t *testing.T, s *leaseStore)) {
	t.Helper()
	for _, store := range []struct {
		name string
		make func(*testing.T) *leaseStore
	}{{"postgres", postgresLeaseStore}, {testenv.MariaDB, mariadbLeaseStore}, {"redis", redisLeaseStore}} {
		t.Run(store.name, func(t *testing.T) {
			t.Parallel()
			f(t, store.make(t))
		})
	}
}

// middleware returns a lease-mode middleware on the store (consumer
// suiteConsumer unless cfg says otherwise, a 5s lease unless cfg.Lease says otherwise, no nack delay).
func (s *leaseStore) middleware(t *testing.T, cfg exactlyonce.Config) *exactlyonce.Guard {
	t.Helper()
	if cfg.Consumer == "" {
		cfg.Consumer = suiteConsumer
	}
	cfg.NackDelay, cfg.OnEvent = -1, s.ev.Observe
	if cfg.Lease == nil {
		cfg.Lease = &exactlyonce.LeaseConfig{Duration: 5 * time.Second}
	}
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	s.with(&cfg)
	eo, err := exactlyonce.New(cfg)
	require.NoError(t, err)
	return eo
}

func (s *leaseStore) record(t *testing.T, key string) leasestore.Record {
	t.Helper()
	rec, err := s.backend.Get(context.Background(), suiteConsumer, key)
	require.NoError(t, err)
	return rec
}

// claimElsewhere claims key as another worker would.
func (s *leaseStore) claimElsewhere(t *testing.T, key string, lease time.Duration) leasestore.Claim {
	t.Helper()
	c, err := s.backend.Claim(context.Background(), suiteConsumer, key, leasestore.Options{Lease: lease})
	require.NoError(t, err)
	require.Equal(t, leasestore.Acquired, c.Outcome)
	return c
}

// recorder is a handler that records the Info of each run and returns
// what result says.
type recorder struct {
	mu     sync.Mutex
	infos  []exactlyonce.Info
	result func(msg *message.Message) error
}

func (r *recorder) handle(msg *message.Message) ([]*message.Message, error) {
	info, err := exactlyonce.InfoFromContext(msg.Context())
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	r.infos = append(r.infos, info)
	result := r.result
	r.mu.Unlock()
	if result != nil {
		return nil, result(msg)
	}
	return nil, nil
}

func (r *recorder) runs() []exactlyonce.Info {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]exactlyonce.Info(nil), r.infos...)
}

func deliverKey(h message.HandlerFunc, key string) error {
	_, err := h(message.NewMessage(key, nil))
	return err
}

func TestLeaseStoresRunOnceThenDuplicate(t *testing.T) {
	t.Parallel()
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		var r recorder
		h := s.middleware(t, exactlyonce.Config{}).Middleware(r.handle)
		require.NoError(t, deliverKey(h, "k1"))
		require.NoError(t, deliverKey(h, "k1"))
		runs := r.runs()
		require.Len(t, runs, 1, "a done key never runs again")
		require.Equal(t, exactlyonce.Info{Consumer: suiteConsumer, Key: "k1", IdempotencyKey: "sms:k1", Attempt: 1,
			LeaseUntil: runs[0].LeaseUntil}, runs[0])
		require.WithinDuration(t, time.Now().Add(5*time.Second), runs[0].LeaseUntil, 2*time.Second)
		require.Equal(t, int64(1), s.ev.Processed.Load())
		require.Equal(t, int64(1), s.ev.Duplicates.Load())
		rec := s.record(t, "k1")
		require.Equal(t, inboxdb.StatusDone, rec.Status)
		require.Equal(t, 1, rec.Attempts)
		require.Equal(t, int64(1), rec.Duplicates)
		require.Nil(t, rec.LeaseUntil)
		require.NotNil(t, rec.ProcessedAt)
	})
}

func TestLeaseStoresRetryAfterError(t *testing.T) {
	t.Parallel()
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		fail := true
		r := recorder{result: func(*message.Message) error {
			if fail {
				return errors.New("provider said 500")
			}
			return nil
		}}
		h := s.middleware(t, exactlyonce.Config{}).Middleware(r.handle)
		require.ErrorContains(t, deliverKey(h, "k"), "provider said 500")
		rec := s.record(t, "k")
		require.Equal(t, inboxdb.StatusFailed, rec.Status)
		require.Equal(t, "provider said 500", rec.LastError)
		fail = false
		require.NoError(t, deliverKey(h, "k"))
		runs := r.runs()
		require.Len(t, runs, 2)
		require.Equal(t, 2, runs[1].Attempt)
		require.Equal(t, "sms:k", runs[1].IdempotencyKey)
		require.Equal(t, runs[0].IdempotencyKey, runs[1].IdempotencyKey, "the same idempotency key on every attempt")
		require.False(t, runs[1].Interrupted, "a handler error is not an interruption")
		require.Equal(t, inboxdb.StatusDone, s.record(t, "k").Status)
	})
}

func TestLeaseStoresPermanentParksUntilReleased(t *testing.T) {
	t.Parallel()
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		ctx := context.Background()
		permanent := true
		r := recorder{result: func(*message.Message) error {
			if permanent {
				return exactlyonce.Permanent(errors.New("invalid phone number"))
			}
			return nil
		}}
		h := s.middleware(t, exactlyonce.Config{}).Middleware(r.handle)
		require.NoError(t, deliverKey(h, "k"), "a permanent failure is acked")
		permanent = false
		require.NoError(t, deliverKey(h, "k"), "a parked key's delivery is acked")
		require.Len(t, r.runs(), 1, "a parked key does not run")
		require.Equal(t, int64(2), s.ev.Parked.Load())

		parked, err := s.backend.Parked(ctx, suiteConsumer, 10)
		require.NoError(t, err)
		require.Len(t, parked, 1)
		require.Equal(t, "k", parked[0].Key)
		require.Equal(t, inboxdb.StatusParked, parked[0].Status)
		require.Contains(t, parked[0].LastError, "invalid phone number")
		require.False(t, parked[0].Interrupted)

		released, err := s.backend.Release(ctx, suiteConsumer, "k")
		require.NoError(t, err)
		require.True(t, released)
		parked, err = s.backend.Parked(ctx, suiteConsumer, 10)
		require.NoError(t, err)
		require.Empty(t, parked)
		require.NoError(t, deliverKey(h, "k"))
		runs := r.runs()
		require.Len(t, runs, 2)
		require.Equal(t, 2, runs[1].Attempt)
		require.Equal(t, "sms:k", runs[1].IdempotencyKey)
		require.Equal(t, inboxdb.StatusDone, s.record(t, "k").Status)
	})
}

// A live lease keeps every other worker off the key; once it expired the
// key is taken over as an interrupted attempt, and the stale holder can
// neither extend, complete nor fail it.
func TestLeaseStoresHeldThenTakenOver(t *testing.T) {
	t.Parallel()
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		ctx := context.Background()
		var r recorder
		h := s.middleware(t, exactlyonce.Config{}).Middleware(r.handle)
		other := s.claimElsewhere(t, "k", time.Minute)
		err := deliverKey(h, "k")
		require.ErrorIs(t, err, exactlyonce.ErrLeaseHeld, "nacked, never acked: the holder may still fail")
		require.Empty(t, r.runs())
		require.Equal(t, int64(1), s.ev.Busy.Load())

		s.expire(t, "k")
		require.NoError(t, deliverKey(h, "k"))
		runs := r.runs()
		require.Len(t, runs, 1)
		require.Equal(t, 2, runs[0].Attempt)
		require.True(t, runs[0].Interrupted)
		require.Equal(t, "sms:k", runs[0].IdempotencyKey)
		rec := s.record(t, "k")
		require.Equal(t, inboxdb.StatusDone, rec.Status)
		require.Equal(t, 2, rec.Attempts)
		require.Equal(t, 1, rec.Interruptions)

		stale := leasestore.Attempt{Consumer: suiteConsumer, Key: "k", Token: other.Token}
		_, err = s.backend.Extend(ctx, stale, time.Minute)
		require.ErrorIs(t, err, exactlyonce.ErrLeaseLost)
		require.ErrorIs(t, s.backend.Fail(ctx, stale, "late", false), exactlyonce.ErrLeaseLost)
		require.ErrorIs(t, s.backend.ParkInterrupted(ctx, stale, "late"), exactlyonce.ErrLeaseLost)
		if !s.backend.Transactional() {
			require.ErrorIs(t, s.backend.Complete(ctx, stale), exactlyonce.ErrLeaseLost)
		}
		owns, err := s.backend.Owns(ctx, stale)
		require.NoError(t, err)
		require.False(t, owns)
		require.Equal(t, inboxdb.StatusDone, s.record(t, "k").Status, "the stale holder changed nothing")
	})
}

func TestLeaseStoresParkAtFirstInterruption(t *testing.T) {
	t.Parallel()
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		var r recorder
		h := s.middleware(t, exactlyonce.Config{Lease: &exactlyonce.LeaseConfig{Duration: 5 * time.Second, MaxInterruptedAttempts: 1}}).
			Middleware(r.handle)
		s.claimElsewhere(t, "k", time.Minute)
		s.expire(t, "k")
		require.NoError(t, deliverKey(h, "k"), "parked and acked")
		require.Empty(t, r.runs(), "a parked key does not run")
		require.Equal(t, int64(1), s.ev.Parked.Load())
		rec := s.record(t, "k")
		require.Equal(t, inboxdb.StatusParked, rec.Status)
		require.Contains(t, rec.LastError, "lease expired during attempt 1")
		require.True(t, rec.Interrupted)
		parked, err := s.backend.Parked(context.Background(), suiteConsumer, 10)
		require.NoError(t, err)
		require.Len(t, parked, 1)

		released, err := s.backend.Release(context.Background(), suiteConsumer, "k")
		require.NoError(t, err)
		require.True(t, released)
		require.NoError(t, deliverKey(h, "k"))
		runs := r.runs()
		require.Len(t, runs, 1)
		require.Equal(t, 2, runs[0].Attempt)
		require.True(t, runs[0].Interrupted, "the released run is told that the parked attempt was cut off")
	})
}

// Workers that hang mid-call (their leases expire): the key runs again,
// interrupted, with the same idempotency key, at most
// MaxInterruptedAttempts times in all; then it is parked. The hung
// workers' completions are refused when they wake up.
func TestLeaseStoresHungWorkersAreBounded(t *testing.T) {
	t.Parallel()
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		wake := make(chan struct{})
		var calls atomic.Int64
		r := recorder{result: func(msg *message.Message) error {
			calls.Add(1)
			<-wake // hung mid-call
			return nil
		}}
		h := s.middleware(t, exactlyonce.Config{}).Middleware(r.handle)
		maxInterrupted := exactlyonce.LeaseConfig{}.WithDefaults().MaxInterruptedAttempts
		var hung []chan error
		for i := 1; i <= maxInterrupted; i++ {
			done := make(chan error, 1)
			go func() { done <- deliverKey(h, "k") }()
			hung = append(hung, done)
			testenv.Eventually(t, 10*time.Second, func() bool { return calls.Load() == int64(i) }, "attempt %d runs", i)
			s.expire(t, "k")
		}
		require.NoError(t, deliverKey(h, "k"), "parked and acked")
		close(wake)
		for _, done := range hung {
			require.ErrorIs(t, <-done, exactlyonce.ErrLeaseLost, "a hung worker's completion is refused")
		}
		runs := r.runs()
		require.Len(t, runs, maxInterrupted)
		for i, info := range runs {
			require.Equal(t, i+1, info.Attempt)
			require.Equal(t, i > 0, info.Interrupted)
			require.Equal(t, "sms:k", info.IdempotencyKey)
		}
		rec := s.record(t, "k")
		require.Equal(t, inboxdb.StatusParked, rec.Status)
		require.Equal(t, maxInterrupted, rec.Interruptions)
		require.Contains(t, rec.LastError, "interrupted")
	})
}

func TestLeaseStoresExtendLease(t *testing.T) {
	t.Parallel()
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		ctx := context.Background()
		h := s.middleware(t, exactlyonce.Config{Lease: &exactlyonce.LeaseConfig{Duration: 2 * time.Second}}).
			Middleware(func(msg *message.Message) ([]*message.Message, error) {
				ctx := msg.Context()
				before, err := exactlyonce.InfoFromContext(ctx)
				require.NoError(t, err)
				require.NoError(t, exactlyonce.ExtendLease(ctx, time.Hour))
				after, err := exactlyonce.InfoFromContext(ctx)
				require.NoError(t, err)
				require.True(t, after.LeaseUntil.After(before.LeaseUntil.Add(50*time.Minute)), "Info follows the extension")
				rec := s.record(t, "k")
				require.True(t, rec.LeaseUntil.After(before.LeaseUntil.Add(50*time.Minute)), "the store holds the extension")

				// Someone takes the key over: extension and completion are refused.
				s.expire(t, "k")
				s.claimElsewhere(t, "k", time.Minute)
				require.ErrorIs(t, exactlyonce.ExtendLease(ctx, 0), exactlyonce.ErrLeaseLost)
				return nil, nil
			})
		require.ErrorIs(t, deliverKey(h, "k"), exactlyonce.ErrLeaseLost, "the completion of a taken-over attempt is refused")
		require.Error(t, exactlyonce.ExtendLease(ctx, time.Second), "outside a lease-mode handler")
		rec := s.record(t, "k")
		require.Equal(t, inboxdb.StatusProcessing, rec.Status, "the new holder's claim stands")
		require.Equal(t, 2, rec.Attempts)
	})
}

// An operator forgets a key while worker A still runs it, and B starts it
// anew (attempt 1 again): A's extension and completion are refused, B's
// commit. Fencing by attempt number would be fooled here.
func TestLeaseStoresFencingSurvivesForget(t *testing.T) {
	t.Parallel()
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		eo := s.middleware(t, exactlyonce.Config{})
		type step struct{ entered, release chan struct{} }
		newStep := func() step { return step{make(chan struct{}), make(chan struct{})} }
		run := func(st step, extended chan<- error) <-chan error {
			done := make(chan error, 1)
			go func() {
				done <- deliverKey(eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					close(st.entered)
					<-st.release
					extended <- exactlyonce.ExtendLease(msg.Context(), time.Minute)
					return nil, nil
				}), "k")
			}()
			return done
		}
		a, b := newStep(), newStep()
		aExt, bExt := make(chan error, 1), make(chan error, 1)
		aDone := run(a, aExt)
		<-a.entered
		forgot, err := s.backend.Forget(context.Background(), suiteConsumer, "k")
		require.NoError(t, err)
		require.True(t, forgot)
		bDone := run(b, bExt)
		<-b.entered
		require.Equal(t, 1, s.record(t, "k").Attempts, "B runs attempt 1 again after Forget")
		close(a.release)
		require.ErrorIs(t, <-aExt, exactlyonce.ErrLeaseLost, "stale A's extension is refused")
		require.ErrorIs(t, <-aDone, exactlyonce.ErrLeaseLost, "stale A's completion is refused")
		close(b.release)
		require.NoError(t, <-bExt)
		require.NoError(t, <-bDone, "B, the holder, completes")
		require.Equal(t, inboxdb.StatusDone, s.record(t, "k").Status)
	})
}

// Copies of one key delivered at the same moment: one runs, the others
// are nacked as held (or acked as duplicates once it is done).
func TestLeaseStoresConcurrentCopiesOneRun(t *testing.T) {
	t.Parallel()
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		var calls atomic.Int64
		h := s.middleware(t, exactlyonce.Config{}).Middleware(func(*message.Message) ([]*message.Message, error) {
			calls.Add(1)
			time.Sleep(100 * time.Millisecond)
			return nil, nil
		})
		const n = 16
		start := make(chan struct{})
		errs := make([]error, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				<-start
				errs[i] = deliverKey(h, "k")
			})
		}
		close(start)
		wg.Wait()
		require.Equal(t, int64(1), calls.Load(), "one copy runs")
		for _, err := range errs {
			if err != nil {
				require.ErrorIs(t, err, exactlyonce.ErrLeaseHeld)
			}
		}
		require.Equal(t, int64(1), s.ev.Processed.Load())
		require.Equal(t, int64(n-1), s.ev.Busy.Load()+s.ev.Duplicates.Load())
		require.Equal(t, inboxdb.StatusDone, s.record(t, "k").Status)
	})
}

// The router closing cancels the message's context after the handler's
// call: the completion is still recorded, so no redelivery repeats it.
func TestLeaseStoresCompletionSurvivesShutdown(t *testing.T) {
	t.Parallel()
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		var calls atomic.Int64
		h := s.middleware(t, exactlyonce.Config{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			calls.Add(1) // the SMS went out
			msg.Context().Value(cancelKey{}).(context.CancelFunc)()
			return nil, nil
		})
		for range 3 {
			ctx, cancel := context.WithCancel(context.Background())
			msg := message.NewMessage("k", nil)
			msg.SetContext(context.WithValue(ctx, cancelKey{}, cancel))
			_, _ = h(msg)
			s.expire(t, "k")
		}
		require.Equal(t, int64(1), calls.Load(), "the completion was recorded despite the shutdown")
		require.Equal(t, inboxdb.StatusDone, s.record(t, "k").Status)
	})
}
