package exactlyonce_test

import (
	"context"
	"errors"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// TestRedisStoreRefusesWhatItCannotHonour: the Redis store's completion is
// one script: New refuses the configuration that would need it to join a
// database transaction, with an error naming the field.
func TestRedisStoreRefusesWhatItCannotHonour(t *testing.T) {
	t.Parallel()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	t.Cleanup(func() { _ = c.Close() })
	store, err := redisstore.New(redisstore.Config{Client: c})
	require.NoError(t, err)
	lease := func() *exactlyonce.LeaseConfig { return &exactlyonce.LeaseConfig{Store: store} }
	for _, tc := range []struct {
		name string
		cfg  exactlyonce.Config
		want string
	}{
		{"DB.Conn", exactlyonce.Config{Lease: lease(), DB: sqlschema.DB{Conn: wsql.BeginnerFromStdSQL(nil)}}, "Config.DB must be empty"},
		{"DB.Schema", exactlyonce.Config{Lease: lease(), DB: sqlschema.DB{Schema: "s"}}, "Config.DB must be empty"},
		{"Batch", exactlyonce.Config{Lease: lease(), Batch: &exactlyonce.BatchConfig{}}, "Config.Batch"},
		{"FailOpen", exactlyonce.Config{Lease: lease(), FailOpen: true}, "Config.FailOpen"},
		{"PublishTopic", exactlyonce.Config{Lease: lease(), PublishTopic: "sent"}, "Config.PublishTopic"},
		{"Duration", exactlyonce.Config{Lease: &exactlyonce.LeaseConfig{Store: store, Duration: time.Millisecond}}, "Config.Lease.Duration"},
	} {
		_, err := exactlyonce.New(tc.cfg)
		require.ErrorContains(t, err, tc.want, tc.name)
	}
	_, err = exactlyonce.New(exactlyonce.Config{Lease: lease()})
	require.NoError(t, err, "no DB needed")
	_, err = exactlyonce.New(exactlyonce.Config{Lease: &exactlyonce.LeaseConfig{Store: &redisstore.Store{}}})
	require.ErrorContains(t, err, "use redisstore.New", "a store not made by its constructor")
	var none *redisstore.Store // a store left nil, e.g. when Redis is not configured
	require.NotPanics(t, func() {
		_, err = exactlyonce.New(exactlyonce.Config{Lease: &exactlyonce.LeaseConfig{Store: none}})
	})
	require.ErrorContains(t, err, "use redisstore.New", "a nil *redisstore.Store")
}

// TestRedisStoreHandlerNeedingADatabaseIsParkedOnce: a handler under the
// Redis store that asks for a transaction or an outbox, or returns
// messages, is misconfigured: no retry can fix it. Its key is parked at
// once with its message (the handler's external call may have happened:
// it is never made again for this key, and an operator replays the kept
// message once the handler is fixed), and every later key of the
// consumer is refused before the handler runs (nacked, kept in the queue
// until the configuration is fixed).
// Before: the key stayed processing and ran again after its lease, the
// provider called once per interrupted attempt before it was parked.
func TestRedisStoreHandlerNeedingADatabaseIsParkedOnce(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		h    func(msg *message.Message) ([]*message.Message, error)
	}{
		{"PgxTxFromContext", func(msg *message.Message) ([]*message.Message, error) {
			_, err := exactlyonce.PgxTxFromContext(msg.Context())
			return nil, err
		}},
		{"StdTxFromContext ignored", func(msg *message.Message) ([]*message.Message, error) {
			_, _ = exactlyonce.StdTxFromContext(msg.Context()) // the handler does not even look
			return nil, nil
		}},
		{"OutboxFromContext", func(msg *message.Message) ([]*message.Message, error) {
			_, err := exactlyonce.OutboxFromContext(msg.Context())
			return nil, err
		}},
		{"Exec", func(msg *message.Message) ([]*message.Message, error) {
			return nil, exactlyonce.Exec(msg.Context(), "SELECT 1")
		}},
		{"outputs", func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{message.NewMessage("out", nil)}, nil
		}},
		{"Permanent after asking", func(msg *message.Message) ([]*message.Message, error) {
			_, err := exactlyonce.PgxTxFromContext(msg.Context())
			return nil, exactlyonce.Permanent(err)
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := redisLeaseStore(t)
			var calls int
			var helperErr error
			h := s.middleware(t, exactlyonce.Config{Lease: &exactlyonce.LeaseConfig{Duration: 5 * time.Second, MaxInterruptedAttempts: 2}}).
				Middleware(func(msg *message.Message) ([]*message.Message, error) {
					calls++ // the provider call
					out, err := tc.h(msg)
					if err != nil && helperErr == nil {
						helperErr = err
					}
					return out, err
				})
			require.NoError(t, deliverKey(h, "k"), "parked at once, acked")
			if helperErr != nil {
				require.ErrorContains(t, helperErr, "the lease store (Config.Lease.Store) is not PostgreSQL")
			}
			require.Equal(t, int64(1), s.ev.Parked.Load())
			rec := s.record(t, "k")
			require.Equal(t, inboxdb.StatusParked, rec.Status)
			require.Contains(t, rec.LastError, "only the PostgreSQL lease store", "the reason says what to fix")
			_, kept := s.kept(t, suiteConsumer, "k")
			require.True(t, kept, "the message is kept for a replay")

			s.expire(t, "k")
			require.NoError(t, deliverKey(h, "k"), "a redelivery is acked as parked")
			err := deliverKey(h, "k2")
			require.ErrorContains(t, err, "only the PostgreSQL lease store", "a later key is refused")
			require.False(t, exactlyonce.IsPermanent(err), "a configuration error waits in the queue for the fix")
			require.Equal(t, 1, calls, "the handler (and its provider) ran once, for the first key only")
			_, err = s.backend.Get(context.Background(), suiteConsumer, "k2")
			require.ErrorIs(t, err, inboxdb.ErrNotFound, "the refused key was not claimed")
		})
	}
}

// TestRedisStoreHandlerWithPublishTopicIsRefusedBeforeItRuns: a handler
// registered with a publish topic (router.AddHandler) under the Redis
// store means to return messages the store cannot record: every delivery
// is refused before the handler runs, nacked and kept.
func TestRedisStoreHandlerWithPublishTopicIsRefusedBeforeItRuns(t *testing.T) {
	t.Parallel()
	s := redisLeaseStore(t)
	q := testenv.Queue(t, "fh2_redis_pub_")
	var run fhRun
	eo := s.middleware(t, exactlyonce.Config{OnEvent: run.Observe})
	r := fhRouter(t)
	r.AddMiddleware(run.Outer, eo.Middleware)
	r.AddHandler("sms", q, testenv.AMQPSubscriber(t, 1), "sent", exactlyonce.OutboxOnly(), func(msg *message.Message) ([]*message.Message, error) {
		run.runs.Add(1)
		return nil, nil
	})
	testenv.StartRouter(t, r)
	fhPublish(t, q, message.NewMessage("k", nil))
	err := run.returnedAt(t, 1)
	require.ErrorIs(t, err, exactlyonce.ErrClaimFailed)
	require.ErrorContains(t, err, `publish topic "sent"`)
	require.ErrorContains(t, err, "Config.Lease.Store")
	fhStop(t, r)
	require.Zero(t, run.runs.Load(), "the handler never ran")
	_, gerr := s.backend.Get(context.Background(), suiteConsumer, "k")
	require.ErrorIs(t, gerr, inboxdb.ErrNotFound, "nothing claimed")
	fhQueueDepth(t, q, 1)
}

// TestRedisStoreUnreachable: a Redis that cannot be reached before the
// handler runs is ErrDBUnavailable, a nack; the handler does not run.
func TestRedisStoreUnreachable(t *testing.T) {
	t.Parallel()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialTimeout: time.Second})
	t.Cleanup(func() { _ = c.Close() })
	store, err := redisstore.New(redisstore.Config{Client: c})
	require.NoError(t, err)
	var ev testenv.Counters
	eo, err := exactlyonce.New(exactlyonce.Config{Lease: &exactlyonce.LeaseConfig{Store: store}, Consumer: "c",
		NackDelay: -1, OnEvent: ev.Observe, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	ran := false
	_, err = eo.Middleware(func(*message.Message) ([]*message.Message, error) {
		ran = true
		return nil, nil
	})(message.NewMessage("k", nil))
	require.ErrorIs(t, err, exactlyonce.ErrDBUnavailable)
	require.False(t, ran)
	require.Equal(t, int64(1), ev.DBUnavailable.Load())
	require.False(t, errors.Is(err, exactlyonce.ErrClaimFailed))
}
