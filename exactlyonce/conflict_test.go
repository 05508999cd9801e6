package exactlyonce_test

// A deadlock between two transactions on the handler's own rows (two
// instances updating per-customer counters in different orders) is a
// conflict, not an error of the message: nothing of it committed, and
// running it again succeeds. It must be logged as that, not at ERROR.

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// TestConflictOnHandlerRows: two instances (two middlewares, consumer
// "c"), each with three deliveries at once; every handler adds one to two
// customers' counters, instance a in the order x, y and instance b in the
// order y, x, and the first handler of each waits, holding its first row,
// until the other holds its own: PostgreSQL detects the deadlock and fails
// one statement (40P01). Every message is processed exactly once (each
// counter ends at 6, six effects), and no line is logged at ERROR, by the
// middleware or by the router (the deliveries' errors go through
// RouterLogger as the router logs them); the conflict is logged at info
// level. With group commit, the victim's batch runs again at once: no
// delivery fails. One transaction per message: the victim's delivery (or
// the victims': the instances' later deliveries may deadlock again) is
// nacked, its error marked reported, and its redelivery succeeds.
// Before: the victim's delivery returned "deadlock detected" and the
// router logged it at ERROR; with group commit it was nacked.
func TestConflictOnHandlerRows(t *testing.T) {
	t.Parallel()
	for _, mode := range eoModes[:2] { // transactional, group commit
		t.Run(mode.name, func(t *testing.T) {
			t.Parallel()
			testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
				counters, effects := b.Table("counters"), b.Table("effects")
				b.Exec(t, "CREATE TABLE "+counters+" (customer "+b.KeyText()+" PRIMARY KEY, n int NOT NULL)")
				b.Exec(t, "INSERT INTO "+counters+" VALUES ('x', 0), ('y', 0)")
				b.Exec(t, "CREATE TABLE "+effects+" (id text NOT NULL)")

				var log fh2Log
				router := exactlyonce.RouterLogger(&log) // as the router logs a delivery's error
				var holding sync.WaitGroup
				holding.Add(2)
				handler := func(order [2]string) message.HandlerFunc {
					first := &atomic.Bool{} // false: the instance's first handler has not waited yet
					return func(msg *message.Message) ([]*message.Message, error) {
						ctx := msg.Context()
						if err := testenv.Exec(ctx, b.Q("UPDATE "+counters+" SET n = n + 1 WHERE customer = $1"), order[0]); err != nil {
							return nil, err
						}
						if first.CompareAndSwap(false, true) {
							holding.Done()
							holding.Wait() // both instances hold their first row
						}
						if err := testenv.Exec(ctx, b.Q("UPDATE "+counters+" SET n = n + 1 WHERE customer = $1"), order[1]); err != nil {
							return nil, err
						}
						return nil, testenv.Exec(ctx, b.Q("INSERT INTO "+effects+" (id) VALUES ($1)"), msg.UUID)
					}
				}
				var ev eventLog
				newEO := func() *exactlyonce.Guard {
					cfg := exactlyonce.Config{DB: b.DB, Consumer: "c", NackDelay: -1, OnEvent: ev.observe, Logger: &log}
					mode.set(&cfg)
					if cfg.Batch != nil {
						cfg.Batch = &exactlyonce.BatchConfig{MaxSize: 3, MaxWait: forever}
					}
					eo, err := exactlyonce.New(cfg)
					require.NoError(t, err)
					return eo
				}
				hA := newEO().Middleware(handler([2]string{"x", "y"}))
				hB := newEO().Middleware(handler([2]string{"y", "x"}))

				var wg sync.WaitGroup
				var mu sync.Mutex
				failed := map[string]error{}
				run := func(h message.HandlerFunc, keys ...string) {
					// Each instance: its deliveries at once.
					wg.Go(func() {
						ds := deliver(t, h, msgs(keys...)...)
						for i, d := range ds {
							if d.err != nil {
								router.Error("Handler returned error", d.err, nil)
								mu.Lock()
								failed[keys[i]] = d.err
								mu.Unlock()
							}
						}
					})
				}
				run(hA, "a-1", "a-2", "a-3")
				run(hB, "b-1", "b-2", "b-3")
				wg.Wait()

				if mode.name == "group-commit" {
					require.Empty(t, failed, "the victim's batch ran again at once")
				} else {
					require.NotEmpty(t, failed, "a delivery was the deadlock's victim")
				}
				for key, err := range failed {
					require.Equal(t, deadlockCode(b), sqlCode(err), "%s: %v", key, err)
					h := hA
					if key[0] == 'b' {
						h = hB
					}
					_, err := h(message.NewMessage(key, nil)) // redelivered
					require.NoError(t, err, key)
				}
				require.Equal(t, int64(6), b.Count(t, "SELECT count(*) FROM "+effects))
				require.Equal(t, int64(6), b.Count(t, "SELECT count(DISTINCT id) FROM "+effects), "each message once")
				require.Equal(t, int64(12), b.Count(t, "SELECT sum(n) FROM "+counters))
				require.Equal(t, int64(6), b.Count(t, "SELECT n FROM "+counters+" WHERE customer = 'x'"))
				require.Equal(t, 6, ev.count(exactlyonce.Processed))
				if n := log.count("ERROR"); n > 0 {
					log.dump(t, "ERROR")
					t.Fatalf("%d lines at ERROR for a conflict that was retried", n)
				}
				require.GreaterOrEqual(t, log.count("INFO", "conflicted with another transaction on the handler's own rows"), 1,
					"the conflict is logged as what it is")
			})
		})
	}
}

// TestConflictKeepsRecurring: a handler whose statement keeps failing
// with a conflict (a deadlock on every run) in a batch: the batch runs
// again with it up to its rerun limit, then the message is nacked, its
// error marked for RouterLogger and logged at info level; the other
// message of the batch is processed once.
func TestConflictKeepsRecurring(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		conflictKeepsRecurring(t, b)
	})
}

// conflictKeepsRecurring is TestConflictKeepsRecurring on b: the handler's
// error is a made-up deadlock of b's dialect.
func conflictKeepsRecurring(t *testing.T, b *testenv.Bundle) {
	effects := b.Table("effects")
	b.Exec(t, "CREATE TABLE "+effects+" (id text NOT NULL)")
	var log fh2Log
	var ev eventLog
	var runs atomic.Int64
	eo, err := exactlyonce.New(exactlyonce.Config{DB: b.DB, Consumer: "c", NackDelay: -1, OnEvent: ev.observe, Logger: &log,
		Batch: &exactlyonce.BatchConfig{MaxSize: 2, MaxWait: forever}})
	require.NoError(t, err)
	h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if msg.UUID == "always" {
			runs.Add(1)
			if b.MySQL() {
				return nil, &mysql.MySQLError{Number: 1213, SQLState: [5]byte{'4', '0', '0', '0', '1'},
					Message: "Deadlock found when trying to get lock; try restarting transaction"}
			}
			return nil, &pgconn.PgError{Severity: "ERROR", Code: "40P01", Message: "deadlock detected"}
		}
		return nil, testenv.Exec(msg.Context(), b.Q("INSERT INTO "+effects+" (id) VALUES ($1)"), msg.UUID)
	})
	ds := deliver(t, h, msgs("always", "fine")...)
	requireOneBatch(t, ds)
	require.NoError(t, ds[1].err)
	require.Error(t, ds[0].err)
	require.Equal(t, deadlockCode(b), sqlCode(ds[0].err))
	if b.MySQL() {
		var me *mysql.MySQLError
		require.True(t, errors.As(ds[0].err, &me))
	} else {
		var pe *pgconn.PgError
		require.True(t, errors.As(ds[0].err, &pe))
	}
	exactlyonce.RouterLogger(&log).Error("Handler returned error", ds[0].err, nil)
	require.Zero(t, log.count("ERROR"), "reported: the router's line is at debug level")
	require.Equal(t, int64(1), b.Count(t, "SELECT count(*) FROM "+effects+" WHERE id = 'fine'"))
	require.Equal(t, []exactlyonce.Outcome{exactlyonce.Nacked}, ev.outcomes("always"))
	require.Equal(t, []exactlyonce.Outcome{exactlyonce.Processed}, ev.outcomes("fine"))
	require.Greater(t, runs.Load(), int64(1), "the batch ran again with it")
	require.LessOrEqual(t, runs.Load(), int64(5), "a bounded number of times")
	require.Equal(t, 1, log.count("INFO", "conflicted with another transaction", "will be redelivered"))
}
