package main

import (
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// writeKeyed writes one message per UUID to topic, each with its ordering
// key (keys[uuid]; none when absent), in one committed transaction.
func writeKeyed(t *testing.T, db sqlschema.DB, topic string, uuids []string, keys map[string]string) {
	t.Helper()
	ctx := testCtx(t)
	tx, err := testenv.Pool(t).Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx) //nolint:errcheck // after Commit: a no-op
	w, err := outbox.NewWriter(db)
	require.NoError(t, err)
	pub, err := w.Publisher(wsql.TxFromPgx(tx))
	require.NoError(t, err)
	for _, u := range uuids {
		msg := msgid.SetOrderingKey(message.NewMessage(u, []byte("payload "+u)), keys[u])
		msg.SetContext(ctx)
		require.NoError(t, pub.Publish(topic, msg))
	}
	require.NoError(t, tx.Commit(ctx))
}

// A blocked ordering key in the CLI: outbox stats counts the keys and the
// rows waiting, outbox pending marks those rows blocked, outbox rows and
// show give each failed row's key and the rows waiting behind it, and
// --ordering-key selects a key's rows, to list them or to discard them,
// which unblocks the key.
func TestOutboxBlockedKeyCommands(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	db := testenv.Schema(t)
	env := dbEnv(db.Schema)
	writeKeyed(t, db, "orders.charged", []string{"A-1", "A-2", "A-3", "B-1", "B-2", "free"},
		map[string]string{"A-1": "order-A", "A-2": "order-A", "A-3": "order-A", "B-1": "order-B", "B-2": "order-B"})
	ctx := testCtx(t)
	_, err := db.Conn.ExecContext(ctx, `UPDATE `+db.Outbox()+` SET failures = 5, attempts = 5, quarantined_at = now(),
 last_error = 'PRECONDITION_FAILED' WHERE uuid = 'A-1'`)
	require.NoError(t, err)

	// stats
	var st outboxStatsJSON
	decode(t, cli(t, env, "outbox", "stats", "--json"), &st)
	require.Equal(t, int64(6), st.Pending)
	require.Equal(t, int64(1), st.Quarantined)
	require.Equal(t, int64(1), st.BlockedKeys)
	require.Equal(t, int64(2), st.BlockedRows, "A-2 and A-3 wait behind A-1")
	r := cli(t, env, "outbox", "stats")
	requireOK(t, r)
	require.Regexp(t, `blocked keys +1 +\(ordering keys held back`, r.stdout)
	require.Regexp(t, `blocked rows +2 `, r.stdout)
	require.Contains(t, r.stdout, "exactlyonce outbox rows --state all lists the failed rows with their ordering key")

	// pending: the rows waiting are blocked; B's and the unkeyed row are
	// ready.
	var p outboxPendingJSON
	decode(t, cli(t, env, "outbox", "pending", "--json"), &p)
	var states, keys []string
	for _, row := range p.Rows {
		states = append(states, row.UUID+":"+row.State)
		keys = append(keys, row.OrderingKey)
	}
	require.Equal(t, []string{"A-1:quarantined", "A-2:blocked", "A-3:blocked", "B-1:ready", "B-2:ready", "free:ready"}, states)
	require.Equal(t, []string{"order-A", "order-A", "order-A", "order-B", "order-B", ""}, keys)
	r = cli(t, env, "outbox", "pending")
	requireOK(t, r)
	require.Regexp(t, `A-2 +\S+ +blocked \(key order-A\) +0 \(0 permanent\)`, r.stdout)

	// rows: the key and the rows waiting; by key.
	var rows rowsJSON
	decode(t, cli(t, env, "outbox", "rows", "--json", "--ordering-key", "order-A"), &rows)
	require.Len(t, rows.Rows, 1)
	require.Equal(t, "A-1", rows.Rows[0].UUID)
	require.Equal(t, "order-A", rows.Rows[0].OrderingKey)
	require.Equal(t, int64(2), rows.Rows[0].Waiting)
	decode(t, cli(t, env, "outbox", "rows", "--json", "--ordering-key", "order-B", "--state", "all"), &rows)
	require.Empty(t, rows.Rows)
	r = cli(t, env, "outbox", "rows")
	requireOK(t, r)
	require.Regexp(t, `ID +TOPIC +UUID +ORDERING KEY +WAITING +STATE`, r.stdout)
	require.Regexp(t, `A-1 +order-A +2 +quarantined +5 \(5 permanent\) +PRECONDITION_FAILED`, r.stdout)
	decode(t, cli(t, env, "outbox", "rows", "--json"), &rows)
	require.Len(t, rows.Rows, 1)
	r = cli(t, env, "outbox", "show", itoa(rows.Rows[0].ID))
	requireOK(t, r)
	require.Regexp(t, `ordering key +order-A\n`, r.stdout)
	require.Regexp(t, `waiting +2 rows of its key behind it`, r.stdout)
	var one rowJSON
	decode(t, cli(t, env, "outbox", "show", "--json", itoa(rows.Rows[0].ID)), &one)
	require.Equal(t, "order-A", one.OrderingKey)
	require.Equal(t, int64(2), one.Waiting)

	// discard by key: a criterion (it counts first), then the key is
	// unblocked.
	var count, done actionJSON
	decode(t, cli(t, env, "outbox", "discard", "--json", "--ordering-key", "order-A"), &count)
	require.Equal(t, actionJSON{Matching: 1}, counted(t, count))
	requireExit(t, cli(t, env, "outbox", "discard", "--json", "--ordering-key", "order-B", "--yes"), exitNotFound,
		"outbox discard: no row matches the criteria: nothing done") // B has no quarantined row
	decode(t, cli(t, env, "outbox", "discard", "--json", "--ordering-key", "order-A", "--yes"), &done)
	require.Equal(t, actionJSON{Count: 1, Done: true}, done)
	decode(t, cli(t, env, "outbox", "stats", "--json"), &st)
	require.Equal(t, outboxStatsJSON{Pending: 5, OldestCreatedAt: st.OldestCreatedAt, OldestAgeSeconds: st.OldestAgeSeconds}, st)
	r = cli(t, env, "outbox", "stats")
	requireOK(t, r)
	require.NotContains(t, r.stdout, "Blocked keys:")

	// A failing row blocks its key too; requeued by key, it is due now and
	// the key is unblocked.
	_, err = db.Conn.ExecContext(ctx, `UPDATE `+db.Outbox()+` SET failures = 3, next_attempt_at = now() + interval '1 hour' WHERE uuid = 'B-1'`)
	require.NoError(t, err)
	decode(t, cli(t, env, "outbox", "stats", "--json"), &st)
	require.Equal(t, [3]int64{1, 1, 1}, [3]int64{st.Failing, st.BlockedKeys, st.BlockedRows})
	var requeued actionJSON
	decode(t, cli(t, env, "outbox", "requeue", "--json", "--state", "failing", "--ordering-key", "order-B", "--yes"), &requeued)
	require.Equal(t, actionJSON{Count: 1, Done: true}, requeued)
	decode(t, cli(t, env, "outbox", "stats", "--json"), &st)
	require.Equal(t, [3]int64{0, 0, 0}, [3]int64{st.Failing, st.BlockedKeys, st.BlockedRows})
}

// outbox relay --once with the broker down: the first row of a key fails,
// the key's later row waits behind it, and the summary says so.
func TestRelayOnceReportsBlockedKeys(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	db := testenv.Schema(t)
	writeKeyed(t, db, "orders.charged", []string{"A-1", "A-2"}, map[string]string{"A-1": "order-A", "A-2": "order-A"})
	down := append(dbEnv(db.Schema), envAMQPURL+"=amqp://guest:guest@127.0.0.1:1/")
	r := cli(t, down, "outbox", "relay", "--once")
	require.Equal(t, exitFailed, r.code, "%s", r)
	require.Contains(t, r.stdout, "Outbox now: 2 pending, 1 failing, 0 quarantined; 1 ordering key blocked (1 row waiting behind a failed row of their key).")

	// Due again at once (not waiting out its backoff), so that the next run
	// tries it again.
	_, err := db.Conn.ExecContext(testCtx(t), `UPDATE `+db.Outbox()+` SET failures = 0, next_attempt_at = NULL, last_error = NULL`)
	require.NoError(t, err)
	r = cli(t, down, "outbox", "relay", "--once", "--json")
	require.Equal(t, exitFailed, r.code, "%s", r)
	var sum relaySummaryJSON
	decode(t, r, &sum)
	require.NotNil(t, sum.Outbox)
	require.Equal(t, int64(1), sum.Outbox.BlockedKeys)
	require.Equal(t, int64(1), sum.Outbox.BlockedRows)
}
