package exactlyonce_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// An operator's discard of a parked message (without forgetting its key)
// leaves the key discarded, in every mode and on both lease stores:
// nothing lists it as parked any more, and a late copy of the message is
// still not run: it is acknowledged as a duplicate, and counted in the
// record as one.
func TestDiscardedKeyIsADuplicate(t *testing.T) {
	t.Parallel()
	type operator interface {
		DiscardParked(ctx context.Context, consumer, key string, opts inbox.DiscardOptions) error
		Parked(ctx context.Context, consumer string, limit int) ([]inbox.Record, error)
		Get(ctx context.Context, consumer, key string) (inbox.Record, error)
	}
	pgStore := func(t *testing.T, cfg *exactlyonce.Config) operator {
		db := testenv.Schema(t)
		cfg.DB = db
		s, err := inbox.NewStore(db)
		require.NoError(t, err)
		return s
	}
	for _, mode := range []struct {
		name  string
		setup func(t *testing.T, cfg *exactlyonce.Config) operator
	}{
		{"transactional", pgStore},
		{"group commit", func(t *testing.T, cfg *exactlyonce.Config) operator {
			cfg.Batch = &exactlyonce.BatchConfig{}
			return pgStore(t, cfg)
		}},
		{"lease/postgres", func(t *testing.T, cfg *exactlyonce.Config) operator {
			cfg.Lease = &exactlyonce.LeaseConfig{Duration: 5 * time.Second}
			return pgStore(t, cfg)
		}},
		{"lease/redis", func(t *testing.T, cfg *exactlyonce.Config) operator {
			c := testenv.Redis(t)
			s, err := redisstore.New(redisstore.Config{Client: c, Prefix: testenv.RedisPrefix(t, c)})
			require.NoError(t, err)
			cfg.Lease = &exactlyonce.LeaseConfig{Duration: 5 * time.Second, Store: s}
			return s
		}},
	} {
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			var ev testenv.Counters
			cfg := exactlyonce.Config{Consumer: "notify", NackDelay: -1, OnEvent: ev.Observe, Logger: testenv.Logger(t)}
			store := mode.setup(t, &cfg)
			eo, err := exactlyonce.New(cfg)
			require.NoError(t, err)
			runs := 0
			deliver := func() {
				t.Helper()
				msg := message.NewMessage("m-1", []byte("payload"))
				msg.SetContext(ctx)
				_, err := eo.Middleware(func(*message.Message) ([]*message.Message, error) {
					runs++
					return nil, exactlyonce.Permanent(errors.New("bad address"))
				})(msg)
				require.NoError(t, err)
			}

			deliver()
			require.Equal(t, 1, runs)
			require.Equal(t, 1, int(ev.Parked.Load()))
			parked, err := store.Parked(ctx, "notify", 10)
			require.NoError(t, err)
			require.Len(t, parked, 1)

			require.NoError(t, store.DiscardParked(ctx, "notify", "m-1", inbox.DiscardOptions{}))
			parked, err = store.Parked(ctx, "notify", 10)
			require.NoError(t, err)
			require.Empty(t, parked, "a discarded key is not listed as parked")
			rec, err := store.Get(ctx, "notify", "m-1")
			require.NoError(t, err)
			require.Equal(t, "discarded", rec.Status)

			deliver()
			require.Equal(t, 1, runs, "a late copy of a discarded message does not run")
			require.Equal(t, 1, int(ev.Duplicates.Load()), "it is acknowledged as a duplicate")
			require.Equal(t, 1, int(ev.Parked.Load()), "not parked again")
			rec, err = store.Get(ctx, "notify", "m-1")
			require.NoError(t, err)
			require.Equal(t, "discarded", rec.Status)
			require.Equal(t, int64(1), rec.Duplicates, "counted in the record")
		})
	}
}
