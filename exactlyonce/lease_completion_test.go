package exactlyonce_test

import (
	"context"
	"errors"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// leaseEnv is a lease-mode middleware over one driver and schema, with a
// provider call counter, for delivering one message again and again.
type leaseEnv struct {
	d      testenv.Driver
	tables sqlschema.DB // Conn is the driver's
	store  *inboxdb.Store
	ev     testenv.Counters
	calls  atomic.Int64
}

// newLeaseEnv makes the env of driver d, of either engine (a fresh schema,
// or a fresh database on MySQL: testenv.NewBundle).
func newLeaseEnv(t *testing.T, d testenv.Driver) *leaseEnv {
	t.Helper()
	e := &leaseEnv{d: d, tables: testenv.NewBundle(t, d).DB}
	var err error
	e.store, err = inboxdb.NewStore(inboxdb.Config{Tables: e.tables})
	require.NoError(t, err)
	return e
}

func (e *leaseEnv) middleware(t *testing.T, cfg exactlyonce.Config) *exactlyonce.Guard {
	t.Helper()
	cfg.DB, cfg.Consumer, cfg.NackDelay, cfg.OnEvent = e.tables, "sms", -1, e.ev.Observe
	if cfg.Lease == nil {
		cfg.Lease = &exactlyonce.LeaseConfig{Duration: 5 * time.Second}
	}
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	eo, err := exactlyonce.New(cfg)
	require.NoError(t, err)
	return eo
}

// expire ends the key's lease now, as if its worker had stopped long ago.
func (e *leaseEnv) expire(t *testing.T, key string) {
	t.Helper()
	_, err := e.d.DB.ExecContext(context.Background(), "UPDATE "+e.tables.Inbox()+e.sql(
		" SET lease_until = now() - interval '1 second' WHERE message_key = $1 AND status = 'processing'",
		" SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND WHERE message_key = ? AND status = 'processing'"), key)
	require.NoError(t, err)
}

// sql returns pg or mysql: a test's own statement in the env's dialect.
func (e *leaseEnv) sql(pg, mysql string) string {
	if e.tables.Dialect == sqlschema.MySQL {
		return mysql
	}
	return pg
}

func (e *leaseEnv) record(t *testing.T, key string) inboxdb.Record {
	t.Helper()
	rec, err := e.store.Lookup(context.Background(), e.d.DB, "sms", key)
	require.NoError(t, err)
	return rec
}

// deliverRepeatedly delivers a message with key n times, ending the lease
// after each delivery (a redelivery that comes after the lease: the worst
// case for a key left processing), and returns the last error.
func (e *leaseEnv) deliverRepeatedly(t *testing.T, h message.HandlerFunc, key string, n int) error {
	t.Helper()
	var err error
	for range n {
		_, err = h(message.NewMessage(key, []byte(`{}`)))
		e.expire(t, key)
	}
	return err
}

// TestLeaseDeterministicCompletionFailureParks: when the handler's external
// call succeeded but its completion can never commit (an output the outbox
// refuses, or a deferred constraint failing at COMMIT), the key is parked
// with the reason and the message acked: redeliveries do not call the
// provider again. Before, the key stayed processing, its lease expired and
// the retry of an expired lease called the provider on every delivery.
func TestLeaseDeterministicCompletionFailureParks(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name   string
		output func(msg *message.Message) []*message.Message
		write  func(ctx context.Context, tables sqlschema.DB) error
		reason string
		// deferred: the case needs a deferred constraint (PostgreSQL's;
		// MySQL checks every constraint at its statement).
		deferred bool
	}{
		{name: "no destination", output: func(msg *message.Message) []*message.Message {
			return []*message.Message{message.NewMessage("out-"+msg.UUID, nil)}
		}, reason: "no destination"},
		{name: "nil output", output: func(*message.Message) []*message.Message {
			return []*message.Message{nil}
		}, reason: "nil message"},
		{name: "metadata not UTF-8", output: func(msg *message.Message) []*message.Message {
			out := message.NewMessage("out-"+msg.UUID, nil)
			exactlyonce.SetDestination(out, "sent")
			out.Metadata.Set("bad", "\xff\xfe")
			return []*message.Message{out}
		}, reason: "UTF-8"},
		{name: "empty output UUID", output: func(*message.Message) []*message.Message {
			out := message.NewMessage("", nil)
			exactlyonce.SetDestination(out, "sent")
			return []*message.Message{out}
		}, reason: "empty UUID"},
		{name: "deferred constraint at commit", write: func(ctx context.Context, tables sqlschema.DB) error {
			return execInTx(ctx, "INSERT INTO "+pgx.Identifier{tables.Schema, "deferred"}.Sanitize()+" (id) VALUES (1), (1)")
		}, reason: "23505", deferred: true},
	}
	testenv.ForEachEngine(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
		for _, c := range cases {
			if c.deferred && d.Dialect == sqlschema.MySQL {
				continue // no deferred constraints: nothing fails at COMMIT
			}
			t.Run(c.name, func(t *testing.T) {
				e := newLeaseEnv(t, d)
				if c.deferred {
					_, err := d.DB.ExecContext(context.Background(), "CREATE TABLE "+pgx.Identifier{e.tables.Schema, "deferred"}.Sanitize()+
						" (id int, CONSTRAINT one_each UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)")
					require.NoError(t, err)
				}
				h := e.middleware(t, exactlyonce.Config{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
					e.calls.Add(1) // the SMS went out
					if c.write != nil {
						if err := c.write(msg.Context(), e.tables); err != nil {
							return nil, err
						}
					}
					if c.output == nil {
						return nil, nil
					}
					return c.output(msg), nil
				})
				err := e.deliverRepeatedly(t, h, "k", 4)
				require.Equal(t, int64(1), e.calls.Load(), "the provider is called once, never again blindly")
				require.NoError(t, err, "a parked key's delivery is acked")
				rec := e.record(t, "k")
				require.Equal(t, inboxdb.StatusParked, rec.Status)
				require.Contains(t, rec.LastError, c.reason)
				require.True(t, rec.Interrupted, "the effect probably happened: the released attempt is told")
				require.Equal(t, int64(4), e.ev.Parked.Load())
				require.Zero(t, testenv.Count(t, d.DB, "SELECT count(*) FROM "+e.tables.Outbox()), "nothing of the failed completion was written")
			})
		}
	})
}

// execInTx runs q through the handler's transaction, whichever driver.
func execInTx(ctx context.Context, q string) error {
	return testenv.Exec(ctx, q)
}

// handlerTx reports whether the handler's transaction (either driver's) is
// in ctx, beginning it in lease mode.
func handlerTx(ctx context.Context) error {
	if _, err := exactlyonce.PgxTxFromContext(ctx); err == nil {
		return nil
	}
	if _, err := exactlyonce.StdTxFromContext(ctx); err != nil {
		return errors.Join(errors.New("no transaction in the handler's context"), err)
	}
	return nil
}

// TestLeaseOutputTopicsAreColumns: an output topic the outbox stores in a
// column is any non-empty text, including characters watermill-sql's
// table-name rule refuses ("/", spaces): the completion commits once.
func TestLeaseOutputTopicsAreColumns(t *testing.T) {
	t.Parallel()
	testenv.ForEachEngine(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
		e := newLeaseEnv(t, d)
		h := e.middleware(t, exactlyonce.Config{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			e.calls.Add(1)
			out := message.NewMessage("out-"+msg.UUID, nil)
			exactlyonce.SetDestination(out, "sms/sent v2")
			return []*message.Message{out}, nil
		})
		require.NoError(t, e.deliverRepeatedly(t, h, "k", 3))
		require.Equal(t, int64(1), e.calls.Load())
		require.Equal(t, inboxdb.StatusDone, e.record(t, "k").Status)
		var topic string
		require.NoError(t, seam.QueryRow(context.Background(), d.DB, "SELECT topic FROM "+e.tables.Outbox(), nil, &topic))
		require.Equal(t, "sms/sent v2", topic)
	})
}

// TestLeaseInterruptionsAreBounded: a key whose attempts keep being
// interrupted (here the completion's connection dies every time after the
// provider call, so the outcome is unknown and the lease expiry decides) is
// retried with the same idempotency key at most MaxInterruptedAttempts
// times in all, then parked for an operator.
func TestLeaseInterruptionsAreBounded(t *testing.T) {
	t.Parallel()
	testenv.ForEachEngine(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
		e := newLeaseEnv(t, d)
		var interrupted atomic.Int64
		h := e.middleware(t, exactlyonce.Config{}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			e.calls.Add(1)
			if info, err := exactlyonce.InfoFromContext(msg.Context()); err != nil {
				t.Error(err)
			} else if info.Interrupted {
				interrupted.Add(1)
			}
			// The completion's connection dies: the outcome is unknown.
			if d.Dialect != sqlschema.MySQL {
				_ = execInTx(msg.Context(), "SELECT pg_terminate_backend(pg_backend_pid())")
			} else {
				// MySQL's KILL takes a literal: from another
				// connection, the handler's transaction's.
				var id int64
				if err := testenv.QueryRow(msg.Context(), "SELECT CONNECTION_ID()", nil, &id); err != nil {
					t.Error(err)
				} else if _, err := d.DB.ExecContext(msg.Context(), "KILL "+strconv.FormatInt(id, 10)); err != nil {
					t.Error(err)
				}
			}
			return nil, nil
		})
		_ = e.deliverRepeatedly(t, h, "k", 8)
		maxInterrupted := exactlyonce.LeaseConfig{}.WithDefaults().MaxInterruptedAttempts
		require.Equal(t, int64(maxInterrupted), e.calls.Load(),
			"at most MaxInterruptedAttempts calls, then parked")
		require.Equal(t, int64(maxInterrupted-1), interrupted.Load())
		rec := e.record(t, "k")
		require.Equal(t, inboxdb.StatusParked, rec.Status)
		require.Contains(t, rec.LastError, "interrupted")
		require.True(t, rec.Interrupted)
	})
}

// TestLeaseCompletionSurvivesShutdown: the router closing cancels the
// message's context while a lease-mode handler finishes. Once the handler's
// external call happened, its completion must still commit (bounded by its
// own timeout), or the key stays processing and its lease expiry runs the
// call again. The handler's own writes use whatever context it gives them;
// here it uses one that outlives the message's, as a handler that must
// record its effect does.
func TestLeaseCompletionSurvivesShutdown(t *testing.T) {
	t.Parallel()
	testenv.ForEachEngine(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
		e := newLeaseEnv(t, d)
		h := e.middleware(t, exactlyonce.Config{PublishTopic: "sent"}).Middleware(func(msg *message.Message) ([]*message.Message, error) {
			e.calls.Add(1) // the SMS went out
			cancel := msg.Context().Value(cancelKey{}).(context.CancelFunc)
			cancel() // the router is closing
			if err := execInTx(context.WithoutCancel(msg.Context()), "SELECT 1"); err != nil {
				return nil, err
			}
			return []*message.Message{message.NewMessage("out-"+msg.UUID, nil)}, nil
		})
		for range 3 {
			ctx, cancel := context.WithCancel(context.WithValue(context.Background(), cancelKey{}, context.CancelFunc(nil)))
			ctx = context.WithValue(ctx, cancelKey{}, cancel)
			msg := message.NewMessage("k", nil)
			msg.SetContext(ctx)
			_, _ = h(msg)
			e.expire(t, "k")
		}
		require.Equal(t, int64(1), e.calls.Load(), "the completion committed despite the shutdown: no second call")
		require.Equal(t, inboxdb.StatusDone, e.record(t, "k").Status)
		require.Equal(t, int64(1), testenv.Count(t, d.DB, "SELECT count(*) FROM "+e.tables.Outbox()), "the output committed with it")
	})
}

type cancelKey struct{}
