package inbox_test

import (
	"fmt"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// claimed runs a transactional claim of (consumer, key), commits it, and
// reports whether the handler would have run.
func (b bundle) claimed(t *testing.T, consumer, key string) bool {
	t.Helper()
	tx, err := b.db.Conn.BeginTx(b.ctx, nil)
	require.NoError(t, err)
	res, err := b.inner.ClaimTx(b.ctx, tx, consumer, key)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	return res.Claimed
}

// A parked message the outbox cannot take (an empty UUID: a producer that
// set none, under a key of its own) is refused as not replayable, and a
// bulk replay skips it instead of failing its whole batch at it every time.
func TestEmptyUUIDIsNotReplayableAndBulkReplayGoesOn(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		for i, uuid := range []string{"u-a", "", "u-c"} {
			msg := &inboxdb.ParkedMessage{UUID: uuid, Topic: "orders.in", Payload: []byte("p"), Metadata: map[string]string{}}
			require.NoError(t, b.inner.Park(b.ctx, b.db.Conn, "c", fmt.Sprintf("k%d", i), "boom", msg))
		}
		_, err := b.store.ReplayParked(b.ctx, "c", "k1", inbox.ReplayOptions{})
		require.ErrorIs(t, err, inbox.ErrNotReplayable)
		require.Contains(t, err.Error(), "outbox cannot take it")

		rep, err := b.store.ReplayParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.ReplayOptions{})
		require.NoError(t, err)
		require.EqualValues(t, 2, rep.Replayed)
		require.EqualValues(t, 1, rep.Skipped)
		uuids := []string{}
		for _, r := range b.outbox(t) {
			uuids = append(uuids, r.UUID)
		}
		require.ElementsMatch(t, []string{"u-a", "u-c"}, uuids)
		m, err := b.store.GetParked(b.ctx, "c", "k1")
		require.NoError(t, err, "the refused message stays parked")
		require.Equal(t, "parked", m.Status)
	})
}

// A bulk replay takes the messages parked before it began: one parked
// again while it runs (its consumer failed on the replay) waits for the
// next replay instead of being published twice by this one.
func TestBulkReplayLeavesMessagesParkedDuringIt(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		const n = 150
		for i := 0; i < n; i++ {
			msg := &inboxdb.ParkedMessage{UUID: fmt.Sprintf("u-%03d", i), Topic: "orders.in", Payload: []byte("p"), Metadata: map[string]string{}}
			require.NoError(t, b.inner.Park(b.ctx, b.db.Conn, "c", fmt.Sprintf("k%03d", i), "boom", msg))
		}
		reparked := make(chan error, 1)
		go func() { // the consumer: takes the replay of k000 and parks it again
			for b.ctx.Err() == nil {
				if testCount(b, `SELECT count(*) FROM `+b.db.Outbox()+` WHERE uuid = 'u-000'`) > 0 {
					msg := &inboxdb.ParkedMessage{UUID: "u-000", Topic: "orders.in", Payload: []byte("p"), Metadata: map[string]string{}}
					reparked <- b.inner.Park(b.ctx, b.db.Conn, "c", "k000", "boom again", msg)
					return
				}
				time.Sleep(time.Millisecond)
			}
			reparked <- b.ctx.Err()
		}()
		rep, err := b.store.ReplayParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.ReplayOptions{BatchSize: 1})
		require.NoError(t, err)
		require.NoError(t, <-reparked)
		require.EqualValues(t, n, rep.Replayed)
		require.EqualValues(t, 1, b.count(t, `SELECT count(*) FROM `+b.db.Outbox()+` WHERE uuid = 'u-000'`),
			"one bulk replay publishes a message once")
		m, err := b.store.GetParked(b.ctx, "c", "k000")
		require.NoError(t, err, "the message parked again waits for the next replay")
		require.Equal(t, "boom again", m.Reason)
	})
}

// testCount counts without a *testing.T (from a goroutine); -1 on error.
func testCount(b bundle, q string) int64 {
	rows, err := b.db.Conn.QueryContext(b.ctx, q)
	if err != nil {
		return -1
	}
	defer rows.Close()
	var n int64 = -1
	if rows.Next() && rows.Scan(&n) != nil {
		return -1
	}
	return n
}

// A discard with Forget takes the key's inbox record before its parked
// message, as a park and a replay do: waiting for a record another
// transaction holds (a replay of the key), it holds no lock on the message
// meanwhile, so the two cannot deadlock.
func TestDiscardForgetLocksTheRecordFirst(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		msg := &inboxdb.ParkedMessage{UUID: "u-1", Topic: "orders.in", Payload: []byte("p"), Metadata: map[string]string{}}
		require.NoError(t, b.inner.Park(b.ctx, b.db.Conn, "c", "k", "card declined", msg))
		holder := b.begin(t) // a replay of the key, holding its record
		_, err := holder.ExecContext(b.ctx, `SELECT 1 FROM `+b.db.Inbox()+` WHERE consumer = 'c' AND message_key = 'k' FOR UPDATE`)
		require.NoError(t, err)

		done := make(chan error, 1)
		go func() { done <- b.store.DiscardParked(b.ctx, "c", "k", inbox.DiscardOptions{Forget: true}) }()
		testenv.Eventually(t, 10*time.Second, func() bool {
			// MySQL: the discard's statement running for 100 ms (the InnoDB
			// lock tables of information_schema are a cache that polling
			// keeps stale).
			return testCount(b, b.sql(`SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%`+b.db.Schema+`%'`,
				`SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID <> CONNECTION_ID() AND COMMAND IN ('Query', 'Execute')
AND TIME_MS >= 100 AND INFO LIKE '%`+b.db.Schema+`%'`)) == 1
		}, "the discard waits for the record")

		probe := b.begin(t)
		_, err = probe.ExecContext(b.ctx, `SELECT 1 FROM `+b.parkedTable()+` WHERE consumer = 'c' AND message_key = 'k' FOR UPDATE NOWAIT`)
		require.NoError(t, err, "the waiting discard holds no lock on the parked message")
		require.NoError(t, probe.Rollback())
		require.NoError(t, holder.Rollback())
		require.NoError(t, <-done)
		require.Equal(t, "", b.status(t, "c", "k"))
	})
}

func (b bundle) begin(t *testing.T) wsql.Tx {
	t.Helper()
	tx, err := b.db.Conn.BeginTx(b.ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}
