package ops_test

import (
	"context"
	"encoding/json"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/internal/ops"
	"github.com/exactlyonce/watermill-exactlyonce/internal/ops/opstest"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// The operator contract against the PostgreSQL inbox, each layout through
// each driver.
func TestContractPostgres(t *testing.T) {
	t.Parallel()
	for _, layout := range testenv.Layouts {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			testenv.ForEachDriver(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
				opstest.Run(t, func(t *testing.T) opstest.Harness {
					return postgresHarness(t, testenv.WithConn(testenv.SchemaLayout(t, layout), d.DB))
				})
			})
		})
	}
}

// The operator contract against the MySQL/MariaDB inbox (plain layout:
// MySQL has no partitioned one).
func TestContractMariaDB(t *testing.T) {
	t.Parallel()
	opstest.Run(t, func(t *testing.T) opstest.Harness {
		d := testenv.DriverNamed(t, testenv.MariaDB)
		return postgresHarness(t, testenv.SchemaMySQL(t, d.DB))
	})
}

// The operator contract against the Redis lease store.
func TestContractRedis(t *testing.T) {
	t.Parallel()
	opstest.Run(t, redisHarness)
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// postgresHarness is the harness of the SQL inbox on db, PostgreSQL or
// MySQL (db.Dialect): its own statements in the dialect's text.
func postgresHarness(t *testing.T, db sqlschema.DB) opstest.Harness {
	mysql := db.Dialect == sqlschema.MySQL
	pick := func(pg, my string) string {
		if mysql {
			return my
		}
		return pg
	}
	store, err := inbox.NewStore(db)
	require.NoError(t, err)
	inner, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	require.NoError(t, err)
	ctx := testCtx(t)
	return opstest.Harness{
		Ctx:   ctx,
		Store: ops.Postgres(store, db),
		Park: func(t *testing.T, consumer, key, reason string, msg *inboxdb.ParkedMessage) {
			t.Helper()
			require.NoError(t, inner.Park(ctx, db.Conn, consumer, key, reason, msg))
		},
		Deliver: func(t *testing.T, consumer, key string) bool {
			t.Helper()
			tx, err := db.Conn.BeginTx(ctx, nil)
			require.NoError(t, err)
			res, err := inner.ClaimTx(ctx, tx, consumer, key)
			require.NoError(t, err)
			require.NoError(t, tx.Commit())
			return res.Claimed
		},
		Age: func(t *testing.T, consumer, key string, ago time.Duration) {
			t.Helper()
			if mysql {
				_, err := db.Conn.ExecContext(ctx, `UPDATE `+inner.ParkedTable()+` SET parked_at = UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND
WHERE consumer = ? AND message_key = ?`, ago.Microseconds(), consumer, key)
				require.NoError(t, err)
				return
			}
			_, err := db.Conn.ExecContext(ctx, `UPDATE `+inner.ParkedTable()+` SET parked_at = now() - make_interval(secs => $3)
WHERE consumer = $1 AND message_key = $2`, consumer, key, ago.Seconds())
			require.NoError(t, err)
		},
		SetStatus: func(t *testing.T, consumer, key, status string) {
			t.Helper()
			if mysql {
				_, err := db.Conn.ExecContext(ctx, `UPDATE `+db.Inbox()+` SET status = ?,
  lease_until = IF(status = 'processing', UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, NULL) WHERE consumer = ? AND message_key = ?`, status, consumer, key)
				require.NoError(t, err)
				return
			}
			_, err := db.Conn.ExecContext(ctx, `UPDATE `+db.Inbox()+` SET status = $3,
  lease_until = CASE WHEN $3 = 'processing' THEN now() + interval '1 hour' END WHERE consumer = $1 AND message_key = $2`, consumer, key, status)
			require.NoError(t, err)
		},
		Replayed: func(t *testing.T) []opstest.Replayed {
			t.Helper()
			rows, err := db.Conn.QueryContext(ctx, pick(`SELECT topic, uuid, payload, metadata::text FROM `+db.Outbox()+` ORDER BY id`,
				`SELECT topic, uuid, payload, metadata FROM `+db.Outbox()+` ORDER BY id`))
			require.NoError(t, err)
			var out []opstest.Replayed
			for rows.Next() {
				var r opstest.Replayed
				var meta string
				require.NoError(t, rows.Scan(&r.Topic, &r.UUID, &r.Payload, &meta))
				require.NoError(t, json.Unmarshal([]byte(meta), &r.Metadata))
				out = append(out, r)
			}
			require.NoError(t, rows.Close())
			return out
		},
	}
}

// recorder is the Redis store's replay publisher: it records.
type recorder struct {
	mu   sync.Mutex
	sent []opstest.Replayed
}

func (p *recorder) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.sent = append(p.sent, opstest.Replayed{Topic: topic, UUID: m.UUID, Payload: m.Payload, Metadata: m.Metadata})
	}
	return nil
}

func (p *recorder) Close() error { return nil }

func redisHarness(t *testing.T) opstest.Harness {
	c := testenv.Redis(t)
	prefix := testenv.RedisPrefix(t, c)
	s, err := redisstore.New(redisstore.Config{Client: c, Prefix: prefix})
	require.NoError(t, err)
	ctx := testCtx(t)
	lb := leasestore.BackendOf(s)
	pub := &recorder{}
	return opstest.Harness{
		Ctx:   ctx,
		Store: ops.Redis(s, func() (message.Publisher, error) { return pub, nil }),
		Park: func(t *testing.T, consumer, key, reason string, msg *inboxdb.ParkedMessage) {
			t.Helper()
			c, err := lb.Claim(ctx, consumer, key, leasestore.Options{Lease: time.Minute, Message: msg})
			require.NoError(t, err)
			require.Equal(t, leasestore.Acquired, c.Outcome)
			require.NoError(t, lb.Fail(ctx, leasestore.Attempt{Consumer: consumer, Key: key, Token: c.Token, Message: msg}, reason, true))
			time.Sleep(time.Millisecond) // the next park in a later millisecond: the store's order
		},
		Deliver: func(t *testing.T, consumer, key string) bool {
			t.Helper()
			c, err := lb.Claim(ctx, consumer, key, leasestore.Options{Lease: time.Minute})
			require.NoError(t, err)
			if c.Outcome != leasestore.Acquired {
				return false
			}
			require.NoError(t, lb.Complete(ctx, leasestore.Attempt{Consumer: consumer, Key: key, Token: c.Token}))
			return true
		},
		Age: func(t *testing.T, consumer, key string, ago time.Duration) {
			t.Helper()
			require.NoError(t, c.HSet(ctx, prefix+"{"+consumer+"}:k:"+key, "parked_at_ms", time.Now().Add(-ago).UnixMilli()).Err())
		},
		SetStatus: func(t *testing.T, consumer, key, status string) {
			t.Helper()
			require.NoError(t, c.HSet(ctx, prefix+"{"+consumer+"}:k:"+key, "status", status).Err())
		},
		Replayed: func(t *testing.T) []opstest.Replayed {
			pub.mu.Lock()
			defer pub.mu.Unlock()
			return append([]opstest.Replayed(nil), pub.sent...)
		},
	}
}
