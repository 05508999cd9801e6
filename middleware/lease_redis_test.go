package exactlyonce_test

import (
	"errors"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	exactlyonce "github.com/exactlyonce/watermill-exactlyonce/middleware"
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
}

// TestRedisStoreHandlerNeedingADatabaseIsNotCompleted: a handler under the
// Redis store that asks for a transaction or an outbox, or returns
// messages, gets a clear error and its delivery is nacked; the key stays
// processing (its effect may have happened), runs again as an interrupted
// attempt after its lease, and is parked after MaxInterruptedAttempts:
// never completed without what the handler meant to write, never lost.
func TestRedisStoreHandlerNeedingADatabaseIsNotCompleted(t *testing.T) {
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
		{"Queue", func(msg *message.Message) ([]*message.Message, error) {
			return nil, exactlyonce.Queue(msg.Context(), "SELECT 1")
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
					calls++
					out, err := tc.h(msg)
					if err != nil && helperErr == nil {
						helperErr = err
					}
					return out, err
				})
			err := deliverKey(h, "k")
			require.ErrorContains(t, err, "cannot record with its completion: not completed")
			require.ErrorContains(t, err, "use the PostgreSQL lease store")
			if helperErr != nil {
				require.ErrorContains(t, helperErr, "the lease store (Config.Lease.Store) is not PostgreSQL")
			}
			require.Equal(t, int64(1), s.ev.Failed.Load(), "nacked")
			rec := s.record(t, "k")
			require.Equal(t, inboxdb.StatusProcessing, rec.Status, "nothing recorded: the lease decides")

			require.ErrorIs(t, deliverKey(h, "k"), exactlyonce.ErrLeaseHeld, "no blind immediate retry")
			s.expire(t, "k")
			require.Error(t, deliverKey(h, "k"), "attempt 2, interrupted, not completed either")
			s.expire(t, "k")
			require.NoError(t, deliverKey(h, "k"), "parked after MaxInterruptedAttempts, acked")
			require.Equal(t, 2, calls)
			rec = s.record(t, "k")
			require.Equal(t, inboxdb.StatusParked, rec.Status)
			require.True(t, rec.Interrupted)
		})
	}
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
