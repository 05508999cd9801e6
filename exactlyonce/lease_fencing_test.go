package exactlyonce_test

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// TestLeaseFencingSurvivesForget: an operator forgets a key while a worker
// (A) is still running it, and the redelivery starts a new attempt 1 on
// another worker (B). A's extension and completion must be refused (it is
// stale), and B's completion must commit. Fencing by attempt number was
// fooled: attempts restart at 1 after Forget, so stale A matched B's row and
// B's completion was refused.
func TestLeaseFencingSurvivesForget(t *testing.T) {
	t.Parallel()
	testenv.ForEachEngine(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
		e := newLeaseEnv(t, d)
		eo := e.middleware(t, exactlyonce.Config{})
		type step struct {
			entered chan struct{}
			release chan struct{}
			extend  chan error
		}
		newStep := func() *step {
			return &step{entered: make(chan struct{}), release: make(chan struct{}), extend: make(chan error, 1)}
		}
		a, b := newStep(), newStep()
		run := func(s *step) <-chan error {
			done := make(chan error, 1)
			go func() {
				_, err := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					close(s.entered)
					<-s.release
					s.extend <- exactlyonce.ExtendLease(msg.Context(), time.Minute)
					return nil, nil
				})(message.NewMessage("k", nil))
				done <- err
			}()
			return done
		}
		aDone := run(a)
		<-a.entered
		forgot, err := e.store.Forget(context.Background(), d.DB, "sms", "k")
		require.NoError(t, err)
		require.True(t, forgot)
		bDone := run(b)
		<-b.entered
		require.Equal(t, 1, e.record(t, "k").Attempts, "B runs attempt 1 again after Forget")

		close(a.release)
		require.ErrorIs(t, <-a.extend, exactlyonce.ErrLeaseLost, "stale A's extension is refused")
		require.ErrorIs(t, <-aDone, exactlyonce.ErrLeaseLost, "stale A's completion is refused")
		close(b.release)
		require.NoError(t, <-b.extend)
		require.NoError(t, <-bDone, "B, the holder, completes")
		require.Equal(t, inboxdb.StatusDone, e.record(t, "k").Status)
	})
}

// TestExtendLeaseSmallPool: with a pool of one connection, a handler that
// holds it (its completion transaction began) can still extend its lease;
// and a handler whose extension waits for a connection someone else holds
// gets an error within its lease instead of blocking until its message
// context ends. PostgreSQL through pgx's pool and database/sql, MariaDB
// through database/sql.
func TestExtendLeaseSmallPool(t *testing.T) {
	t.Parallel()
	tables := testenv.Schema(t)
	mysqlTables := testenv.SchemaMySQL(t, wsql.BeginnerFromStdSQL(testenv.MySQLDB(t)))
	my := testenv.MySQLDBFor(t, testenv.MySQLDSN(testenv.MySQLURL()))
	my.SetMaxOpenConns(1)
	pgxCfg, err := pgxpool.ParseConfig(testenv.DatabaseURL())
	require.NoError(t, err)
	pgxCfg.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(context.Background(), pgxCfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	connCfg, err := pgx.ParseConfig(testenv.DatabaseURL())
	require.NoError(t, err)
	std := stdlib.OpenDB(*connCfg)
	std.SetMaxOpenConns(1)
	t.Cleanup(func() { _ = std.Close() })

	type smallPool struct {
		name   string
		tables sqlschema.DB
		db     wsql.Beginner
		hold   func(t *testing.T) (release func())
	}
	for i, p := range []smallPool{
		{name: "pgxpool", tables: tables, db: wsql.BeginnerFromPgx(pool), hold: func(t *testing.T) func() {
			c, err := pool.Acquire(context.Background())
			require.NoError(t, err)
			return c.Release
		}},
		{name: "database-sql", tables: tables, db: wsql.BeginnerFromStdSQL(std), hold: func(t *testing.T) func() {
			c, err := std.Conn(context.Background())
			require.NoError(t, err)
			return func() { _ = c.Close() }
		}},
		{name: testenv.MariaDB, tables: mysqlTables, db: wsql.BeginnerFromStdSQL(my), hold: func(t *testing.T) func() {
			c, err := my.Conn(context.Background())
			require.NoError(t, err)
			return func() { _ = c.Close() }
		}},
	} {
		t.Run(p.name, func(t *testing.T) {
			const lease = 2 * time.Second
			eo, err := exactlyonce.New(exactlyonce.Config{DB: testenv.WithConn(p.tables, p.db),
				Lease:    &exactlyonce.LeaseConfig{Duration: lease},
				Consumer: "c" + string(rune('0'+i)), NackDelay: -1, Logger: testenv.Logger(t)})
			require.NoError(t, err)

			// The handler holds the only connection (its transaction began).
			var extended time.Time
			_, err = callWithin(t, 10*time.Second, func() ([]*message.Message, error) {
				return eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					ctx := msg.Context()
					before, err := exactlyonce.InfoFromContext(ctx)
					if err != nil {
						return nil, err
					}
					if err := handlerTx(ctx); err != nil {
						t.Error(err)
					}
					if err := exactlyonce.ExtendLease(ctx, time.Hour); err != nil {
						return nil, err
					}
					info, err := exactlyonce.InfoFromContext(ctx)
					if err != nil {
						return nil, err
					}
					extended = info.LeaseUntil
					if !info.LeaseUntil.After(before.LeaseUntil.Add(50 * time.Minute)) {
						t.Errorf("lease not extended: %s -> %s", before.LeaseUntil, info.LeaseUntil)
					}
					return nil, nil
				})(message.NewMessage("held", nil))
			})
			require.NoError(t, err, "extending while holding the only connection")
			require.False(t, extended.IsZero())

			// Someone else holds the only connection while the handler
			// extends: an error within the lease, not a hang.
			var extendErr error
			var took time.Duration
			_, _ = callWithin(t, 10*time.Second, func() ([]*message.Message, error) {
				return eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
					release := p.hold(t)
					defer release()
					start := time.Now()
					extendErr = exactlyonce.ExtendLease(msg.Context(), time.Hour)
					took = time.Since(start)
					return nil, nil
				})(message.NewMessage("starved", nil))
			})
			require.Error(t, extendErr, "no connection within the lease")
			require.Less(t, took, lease+time.Second, "ExtendLease waited longer than the lease")
		})
	}
}

// callWithin runs f and fails the test if it does not return within d.
func callWithin(t *testing.T, d time.Duration, f func() ([]*message.Message, error)) ([]*message.Message, error) {
	t.Helper()
	type result struct {
		out []*message.Message
		err error
	}
	ch := make(chan result, 1)
	go func() {
		out, err := f()
		ch <- result{out, err}
	}()
	select {
	case r := <-ch:
		return r.out, r.err
	case <-time.After(d):
		t.Fatalf("did not return within %s (blocked)", d)
		return nil, nil
	}
}
