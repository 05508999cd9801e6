package inbox_test

import (
	stdsql "database/sql"
	"errors"
	"strconv"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// The adversary's interleavings of an action with an Expect: a second
// operator (or a delivery) acts on the key between the check and the act,
// inside the action's own transaction. The second party holds the key (an
// open transaction that replayed it, then parked it again or processed
// it); the action, started meanwhile, waits for it under its locks, and
// once the second party commits it must see what it did and refuse
// (ErrChanged, or ErrNotParked when the message is gone), changing
// nothing. Both layouts and drivers (eachLayout), and under a database
// whose default isolation is REPEATABLE READ or SERIALIZABLE, and through
// PgBouncer in transaction pooling (eachConnection).
func TestExpectSeesWhatAnotherPartyDidWhileItWaited(t *testing.T) {
	t.Parallel()
	eachConnection(t, func(t *testing.T, b bundle) {
		msg := func(uuid string) *inboxdb.ParkedMessage {
			return &inboxdb.ParkedMessage{UUID: uuid, Topic: "orders.in", Payload: []byte("p-" + uuid), Metadata: map[string]string{}}
		}
		type action struct {
			name string
			// shown is what the operator saw (m: the parked message, r:
			// the record) as an Expect.
			shown func(m inbox.ParkedMessage, r inbox.Record) inbox.Expect
			run   func(key string, e inbox.Expect) error
		}
		messageActions := []action{
			{"discard", func(m inbox.ParkedMessage, _ inbox.Record) inbox.Expect { return inbox.Expect{Version: m.Version} },
				func(key string, e inbox.Expect) error {
					return b.store.DiscardParked(b.ctx, "c", key, inbox.DiscardOptions{Expect: e})
				}},
			{"discard-forget", func(m inbox.ParkedMessage, _ inbox.Record) inbox.Expect { return inbox.Expect{Version: m.Version} },
				func(key string, e inbox.Expect) error {
					return b.store.DiscardParked(b.ctx, "c", key, inbox.DiscardOptions{Forget: true, Expect: e})
				}},
			{"replay", func(m inbox.ParkedMessage, _ inbox.Record) inbox.Expect { return inbox.Expect{Version: m.Version} },
				func(key string, e inbox.Expect) error {
					_, err := b.store.ReplayParked(b.ctx, "c", key, inbox.ReplayOptions{Expect: e})
					return err
				}},
		}
		recordActions := []action{
			{"forget", func(_ inbox.ParkedMessage, r inbox.Record) inbox.Expect { return inbox.Expect{Version: r.Version} },
				func(key string, e inbox.Expect) error { _, err := b.store.Forget(b.ctx, "c", key, e); return err }},
			{"release", func(_ inbox.ParkedMessage, r inbox.Record) inbox.Expect { return inbox.Expect{Version: r.Version} },
				func(key string, e inbox.Expect) error { _, err := b.store.Release(b.ctx, "c", key, e); return err }},
		}

		// interleave parks key with u1, shows it, lets second act on it in
		// an open transaction, starts a, waits until a waits for second,
		// commits second and returns a's error.
		interleave := func(t *testing.T, key string, a action, second func(tx wsql.Tx)) error {
			t.Helper()
			require.NoError(t, b.inner.Park(b.ctx, b.db.Conn, "c", key, "card declined", msg("u1-"+key)))
			m, err := b.store.GetParked(b.ctx, "c", key)
			require.NoError(t, err)
			r, err := b.store.Get(b.ctx, "c", key)
			require.NoError(t, err)
			e := a.shown(m, r)

			tx, err := b.db.Conn.BeginTx(b.ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
			require.NoError(t, err)
			t.Cleanup(func() { _ = tx.Rollback() })
			var pid int
			require.NoError(t, seam.QueryRow(b.ctx, tx, b.sql(`SELECT pg_backend_pid()`, `SELECT CONNECTION_ID()`), nil, &pid))
			second(tx)

			done := make(chan error, 1)
			go func() { done <- a.run(key, e) }()
			testenv.Eventually(t, 20*time.Second, func() bool {
				// MySQL: a statement of the action on the schema running for
				// 100 ms (the InnoDB lock tables of information_schema are a
				// cache that polling keeps stale).
				return testCount(b, b.sql(`SELECT count(*) FROM pg_stat_activity WHERE `+strconv.Itoa(pid)+` = ANY(pg_blocking_pids(pid))`,
					`SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID NOT IN (CONNECTION_ID(), `+strconv.Itoa(pid)+`)
AND COMMAND IN ('Query', 'Execute') AND TIME_MS >= 100 AND INFO LIKE '%`+b.db.Schema+`%'`)) > 0
			}, "the %s waits for the second party's transaction", a.name)
			require.NoError(t, tx.Commit())
			select {
			case err := <-done:
				return err
			case <-b.ctx.Done():
				t.Fatalf("the %s did not end", a.name)
				return nil
			}
		}

		for _, a := range messageActions {
			t.Run(a.name+" while another operator replays it and it is parked again", func(t *testing.T) {
				key := a.name + "-reparked"
				err := interleave(t, key, a, func(tx wsql.Tx) {
					_, err := b.store.ReplayParkedTx(b.ctx, tx, "c", key, inbox.ReplayOptions{})
					require.NoError(t, err)
					// The replayed message failed again: parked with u2.
					require.NoError(t, b.inner.Park(b.ctx, tx, "c", key, "declined again", msg("u2-"+key)))
				})
				require.ErrorIs(t, err, inbox.ErrChanged)
				m, err := b.store.GetParked(b.ctx, "c", key)
				require.NoError(t, err)
				require.Equal(t, "u2-"+key, m.UUID, "the message nobody saw is untouched")
				require.Equal(t, "parked", m.Status)
				require.EqualValues(t, 1, b.count(t, `SELECT count(*) FROM `+b.db.Outbox()+` WHERE uuid = `+b.sql("$1", "?"), "u1-"+key),
					"replayed once, by the second operator")
				require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.db.Outbox()+` WHERE uuid = `+b.sql("$1", "?"), "u2-"+key))
			})
			t.Run(a.name+" while the key is replayed and processed", func(t *testing.T) {
				key := a.name + "-processed"
				err := interleave(t, key, a, func(tx wsql.Tx) {
					_, err := b.store.ReplayParkedTx(b.ctx, tx, "c", key, inbox.ReplayOptions{})
					require.NoError(t, err)
					res, err := b.inner.ClaimTx(b.ctx, tx, "c", key)
					require.NoError(t, err)
					require.True(t, res.Claimed)
				})
				require.True(t, errors.Is(err, inbox.ErrChanged) || errors.Is(err, inbox.ErrNotParked), "refused: %v", err)
				require.Equal(t, "done", b.status(t, "c", key), "the done record stays: a late copy is a duplicate")
			})
		}
		for _, a := range recordActions {
			t.Run(a.name+" while the key is replayed and processed", func(t *testing.T) {
				key := a.name + "-processed"
				err := interleave(t, key, a, func(tx wsql.Tx) {
					_, err := b.store.ReplayParkedTx(b.ctx, tx, "c", key, inbox.ReplayOptions{})
					require.NoError(t, err)
					res, err := b.inner.ClaimTx(b.ctx, tx, "c", key)
					require.NoError(t, err)
					require.True(t, res.Claimed)
				})
				require.ErrorIs(t, err, inbox.ErrChanged)
				require.Equal(t, "done", b.status(t, "c", key), "the done record stays: a late copy is a duplicate")
			})
			t.Run(a.name+" while the key is forgotten and recorded again", func(t *testing.T) {
				key := a.name + "-again"
				err := interleave(t, key, a, func(tx wsql.Tx) {
					_, err := tx.ExecContext(b.ctx, `DELETE FROM `+b.db.Inbox()+` WHERE consumer = 'c' AND message_key = `+b.sql("$1", "?"), key)
					require.NoError(t, err)
					_, err = tx.ExecContext(b.ctx, `DELETE FROM `+b.parkedTable()+` WHERE consumer = 'c' AND message_key = `+b.sql("$1", "?"), key)
					require.NoError(t, err)
					require.NoError(t, b.inner.Park(b.ctx, tx, "c", key, "declined again", msg("u2-"+key)))
				})
				require.True(t, errors.Is(err, inbox.ErrChanged) || errors.Is(err, inbox.ErrNotFound), "refused: %v", err)
				m, err := b.store.GetParked(b.ctx, "c", key)
				require.NoError(t, err)
				require.Equal(t, "u2-"+key, m.UUID)
				require.Equal(t, "parked", m.Status, "the new park is untouched")
			})
		}
	})
}

// eachConnection runs f as eachLayout does, and besides on both layouts
// over a database whose default isolation is REPEATABLE READ or
// SERIALIZABLE, and through PgBouncer in transaction pooling.
func eachConnection(t *testing.T, f func(t *testing.T, b bundle)) {
	t.Helper()
	eachLayout(t, f)
	urls := map[string]func(t *testing.T) string{
		"repeatable-read": func(t *testing.T) string { return testenv.DatabaseURLWithIsolation(t, testenv.RepeatableRead) },
		"serializable":    func(t *testing.T) string { return testenv.DatabaseURLWithIsolation(t, testenv.Serializable) },
		"pgbouncer":       func(t *testing.T) string { return testenv.PgBouncer(t, "transaction") },
	}
	for name, url := range urls {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			u := url(t)
			for _, layout := range testenv.Layouts {
				for _, d := range testenv.DriversFor(t, u) {
					t.Run(layout+"/"+d.Name, func(t *testing.T) {
						if name != "pgbouncer" { // its 4 server connections: one at a time
							t.Parallel()
						}
						f(t, newBundle(t, testenv.WithConn(testenv.SchemaLayout(t, layout), d.DB), 90*time.Second))
					})
				}
			}
		})
	}
}

// eachPartitioned runs f per driver on the partitioned layout.
func eachPartitioned(t *testing.T, f func(t *testing.T, b bundle, l inboxpart.Layout)) {
	t.Helper()
	testenv.ForEachDriver(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
		db := testenv.WithConn(testenv.SchemaLayout(t, "partitioned"), d.DB)
		f(t, newBundle(t, db, 60*time.Second),
			inboxpart.Layout{Schema: db.Schema, Table: db.InboxTable, Ahead: db.Partitions.Ahead})
	})
}

// pastPartition attaches the daily partition daysAgo days before today (as
// maintenance names it) and returns its start.
func (b bundle) pastPartition(t *testing.T, l inboxpart.Layout, daysAgo int) time.Time {
	t.Helper()
	var now time.Time
	require.NoError(t, seam.QueryRow(b.ctx, b.db.Conn, "SELECT now()", nil, &now))
	from := l.Floor(now).AddDate(0, 0, -daysAgo)
	q := l.Quoted(l.Name(from))
	b.exec(t, "CREATE TABLE "+q+" (LIKE "+l.Parent()+" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
	b.exec(t, "ALTER TABLE "+l.Parent()+" ATTACH PARTITION "+q+" FOR VALUES FROM ("+inboxpart.Literal(from)+") TO ("+
		inboxpart.Literal(from.AddDate(0, 0, 1))+")")
	return from
}

// recordAt writes a record of (c, key) with status into the partition of
// at, first seen then, finished at finished.
func (b bundle) recordAt(t *testing.T, key, status string, at, finished time.Time) {
	t.Helper()
	b.exec(t, "INSERT INTO "+b.db.Inbox()+` (consumer, message_key, status, attempts, first_seen_at, processed_at, partition_at, parked_by_transaction)
VALUES ('c', $1, $2, 1, $3, $4, $3, true)`, key, status, at, finished)
}

// Retention's move of a record (the partitioned layout's purge moves the
// records a partition past retention must keep) is not a change an
// operator sees: the versions shown before the move still act after it.
// A key discarded lately in an old partition is kept as long as a done one
// finished then would be (its late copy stays a duplicate), one discarded
// long ago goes.
func TestExpectAcrossARetentionMove(t *testing.T) {
	t.Parallel()
	eachPartitioned(t, func(t *testing.T, b bundle, l inboxpart.Layout) {
		p := b.pastPartition(t, l, 3)
		at := p.Add(time.Hour)
		for _, k := range []string{"a", "b"} {
			b.recordAt(t, k, "parked", at, at)
			b.seedMessage(t, parkedMsg{consumer: "c", key: k, uuid: "u-" + k, topic: "orders.in", payload: []byte("p")})
		}
		b.recordAt(t, "discarded-lately", "discarded", at, time.Now().Add(-time.Minute))
		b.recordAt(t, "discarded-long-ago", "discarded", at, at)
		ma, err := b.store.GetParked(b.ctx, "c", "a")
		require.NoError(t, err)
		mb, err := b.store.GetParked(b.ctx, "c", "b")
		require.NoError(t, err)
		rb, err := b.store.Get(b.ctx, "c", "b")
		require.NoError(t, err)

		_, err = b.store.Purge(b.ctx, inbox.PurgeOptions{OlderThan: time.Hour})
		require.NoError(t, err)
		parts, err := l.List(b.ctx, b.db.Conn)
		require.NoError(t, err)
		for _, q := range parts {
			require.NotEqual(t, l.Name(p), q.Name, "the old partition was dropped, its records to keep moved")
		}

		m, err := b.store.GetParked(b.ctx, "c", "a")
		require.NoError(t, err)
		require.Equal(t, ma.Version, m.Version, "moved: the same message")
		r, err := b.store.Get(b.ctx, "c", "b")
		require.NoError(t, err)
		require.Equal(t, rb.Version, r.Version, "moved: the same record")
		require.NoError(t, b.store.DiscardParked(b.ctx, "c", "a", inbox.DiscardOptions{Expect: inbox.Expect{Version: ma.Version}}))
		require.Equal(t, "discarded", b.status(t, "c", "a"))
		ok, err := b.store.Release(b.ctx, "c", "b", inbox.Expect{Version: rb.Version})
		require.NoError(t, err)
		require.True(t, ok)
		_, err = b.store.ReplayParked(b.ctx, "c", "b", inbox.ReplayOptions{Expect: inbox.Expect{Version: mb.Version}})
		require.NoError(t, err)

		require.False(t, b.claimed(t, "c", "a"), "a late copy of a discarded key is a duplicate")
		require.False(t, b.claimed(t, "c", "discarded-lately"), "kept by retention: discarded within OlderThan")
		require.True(t, b.claimed(t, "c", "discarded-long-ago"), "aged out as a done record finished then")
	})
}

// A bulk discard that keeps the keys (they become discarded) updates their
// records without the keys' locks: a purge moving a record meanwhile makes
// its UPDATE fail with a serialization failure ("tuple to be locked was
// already moved to another partition"). The race is made deterministic as
// in inboxdb's TestPartitionedLeaseCompletionRacingTheMove: a holder keeps
// the row lock of a second record the move takes, so the move holds the
// first record while the discard reaches it. The discard must end with the
// key discarded, not with an error. (Seen: its batch fails with 40001 once
// and runs again: inTx retries a serialization failure.)
func TestBulkDiscardRacingARetentionMove(t *testing.T) {
	t.Parallel()
	for _, forget := range []bool{false, true} {
		t.Run("forget="+strconv.FormatBool(forget), func(t *testing.T) {
			t.Parallel()
			eachPartitioned(t, func(t *testing.T, b bundle, l inboxpart.Layout) {
				p := b.pastPartition(t, l, 3)
				at := p.Add(time.Hour)
				b.recordAt(t, "a", "parked", at, at)
				b.seedMessage(t, parkedMsg{consumer: "c", key: "a", uuid: "u-a", topic: "orders.in", payload: []byte("p"), reason: "bulk me"})
				b.recordAt(t, "z", "parked", at, at)

				holder := b.begin(t)
				_, err := holder.ExecContext(b.ctx, "SELECT 1 FROM "+b.db.Inbox()+" WHERE consumer = 'c' AND message_key = 'z' FOR UPDATE")
				require.NoError(t, err)
				var holderPID int
				require.NoError(t, seam.QueryRow(b.ctx, holder, `SELECT pg_backend_pid()`, nil, &holderPID))
				purged := make(chan error, 1)
				go func() {
					_, err := b.store.Purge(b.ctx, inbox.PurgeOptions{OlderThan: time.Hour})
					purged <- err
				}()
				testenv.Eventually(t, 20*time.Second, func() bool {
					return testCount(b, `SELECT count(*) FROM pg_stat_activity WHERE `+strconv.Itoa(holderPID)+` = ANY(pg_blocking_pids(pid))`) > 0
				}, "the move waits for z's row lock, holding a's")

				discarded := make(chan error, 1)
				go func() {
					_, err := b.store.DiscardParkedMatching(b.ctx, inbox.ParkedFilter{Reason: "bulk me"}, inbox.DiscardOptions{Forget: forget})
					discarded <- err
				}()
				testenv.Eventually(t, 20*time.Second, func() bool {
					return testCount(b, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%`+b.db.Schema+`%'`) >= 2
				}, "the discard waits for the move")
				require.NoError(t, holder.Rollback())
				require.NoError(t, <-purged)
				require.NoError(t, <-discarded, "the bulk discard met the move of a record")
				want := "discarded"
				if forget {
					want = ""
				}
				require.Equal(t, want, b.status(t, "c", "a"))
				_, err = b.store.GetParked(b.ctx, "c", "a")
				require.ErrorIs(t, err, inbox.ErrNotParked)
			})
		})
	}
}
