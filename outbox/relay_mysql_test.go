package outbox_test

import (
	"context"
	stdsql "database/sql"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// mariaBundle is a bundle on MariaDB alone: the behaviour of the relay
// that is MySQL's only (no LISTEN, the in-process wake, its plans).
func mariaBundle(t *testing.T) bundle {
	t.Helper()
	d := testenv.DriverNamed(t, testenv.MariaDB)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return newBundle(t, ctx, d.DB, testenv.SchemaMySQL(t, d.DB))
}

// On MySQL there is no LISTEN: Run says once that it polls, Listening
// stays false, and a commit of this process wakes the relay at once when
// its writer calls WakeRelays; a row committed without it waits for the
// poll (an hour here: the check can fail).
func TestRelayMySQLWakesInProcess(t *testing.T) {
	t.Parallel()
	b := mariaBundle(t)
	logger := watermill.NewCaptureLogger()
	rec := &recorder{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, Logger: logger, PollInterval: slowPoll})
	require.NoError(t, err)
	runRelay(t, relay)
	polls := func() int {
		n := 0
		for _, l := range logger.Captured()[watermill.InfoLogLevel] {
			if strings.Contains(l.Msg, "not available on MySQL") {
				n++
			}
		}
		return n
	}
	testenv.Eventually(t, 10*time.Second, func() bool { return polls() == 1 }, "Run should say that it polls")
	// The first poll, at start, found nothing; the next is an hour away.
	time.Sleep(100 * time.Millisecond)

	b.publish(t, "t", message.NewMessage("unsignalled", nil))
	time.Sleep(300 * time.Millisecond)
	require.Zero(t, rec.count(), "a row committed without a wake waits for the poll")

	b.publish(t, "t", message.NewMessage("signalled", nil))
	outbox.WakeRelays(b.schema())
	waitDelivered(t, rec, 2, 5*time.Second, "after WakeRelays")
	require.False(t, relay.Stats().Listening)
	require.Equal(t, 1, polls(), "said once")

	// Another table's wake does not reach it.
	other := b.schema()
	other.OutboxTable = "other_outbox"
	b.publish(t, "t", message.NewMessage("third", nil))
	outbox.WakeRelays(other)
	time.Sleep(300 * time.Millisecond)
	require.Equal(t, 2, rec.count(), "a wake of another table")
}

// The batch's statements on a 100k-row MariaDB table use the indexes: the
// locking reads join the ids given to the primary key (no scan, no sort),
// the fresh rows are a walk of the primary key, the heads and the
// followers are asked of the ordering_key index. (That throughput stays
// flat with the backlog is the benchmark's to show.)
func TestRelayMySQLClaimPlan(t *testing.T) {
	t.Parallel()
	b := mariaBundle(t)
	b.exec(t, "INSERT INTO "+b.tables.Outbox()+" (topic, uuid, payload, metadata, created_at, ordering_key)"+
		" SELECT 'one', CONCAT('u', seq), X'7b7d', '{}', UTC_TIMESTAMP(6), IF(seq % 2 = 0, CONCAT('k', seq % 1000), NULL) FROM seq_1_to_100000")
	b.exec(t, "UPDATE "+b.tables.Outbox()+" SET failures = 1 WHERE id % 100 = 0")
	b.exec(t, "ANALYZE TABLE "+b.tables.Outbox())
	store, err := outboxdb.New(b.schema())
	require.NoError(t, err)
	st := map[string]string{}
	for _, s := range store.Statements() {
		st[s.Name] = s.SQL
	}
	ids := "[" + strings.Repeat("1,", 99) + "2]"
	raw := testenv.MySQLDB(t) // Columns: the plan's every column
	explain := func(name string, args ...any) string {
		rs, err := raw.QueryContext(b.ctx, "EXPLAIN "+st[name], args...)
		require.NoError(t, err, name)
		cols, err := rs.Columns()
		require.NoError(t, err)
		var out strings.Builder
		for rs.Next() {
			vals := make([]any, len(cols))
			ptrs := make([]any, len(cols))
			for i := range vals {
				ptrs[i] = &vals[i]
			}
			require.NoError(t, rs.Scan(ptrs...))
			for i, v := range vals {
				if b, ok := v.([]byte); ok {
					v = string(b)
				}
				fmt.Fprintf(&out, "%s=%v ", cols[i], v)
			}
			out.WriteString("\n")
		}
		require.NoError(t, rs.Close())
		t.Logf("%s:\n%s", name, out.String())
		return out.String()
	}
	for _, name := range []string{"LockDue", "LockFresh"} {
		plan := explain(name, ids, "[]", 100)
		require.Contains(t, plan, "type=eq_ref possible_keys=PRIMARY key=PRIMARY", name)
		require.NotContains(t, plan, "filesort", name)
		require.NotContains(t, plan, "type=ALL possible_keys=PRIMARY", name)
	}
	for _, name := range []string{"DeleteRelayed", "Recorded"} {
		plan := explain(name, ids)
		require.Contains(t, plan, "type=eq_ref possible_keys=PRIMARY key=PRIMARY", name)
	}
	plan := explain("Blocked", "[[2, 0], [4, 2]]")
	require.Contains(t, plan, "type=eq_ref possible_keys=PRIMARY key=PRIMARY")
	require.Contains(t, plan, "_ordering_key")
	plan = explain("FreshPlain", "[]", 100)
	require.Contains(t, plan, "type=index")
	require.Contains(t, plan, "key=PRIMARY")
	require.NotContains(t, plan, "filesort")
	plan = explain("Follow", []byte("k2"), 2, 50)
	require.Contains(t, plan, "type=range")
	require.Contains(t, plan, "_ordering_key")
	require.NotContains(t, plan, "filesort", "the key's rows after the head, in the index's order, to the LIMIT")
	plan = explain("WindowHeads", "[]", "[]", "[]", 400)
	require.Contains(t, plan, "_ordering_key")
	require.NotContains(t, plan, "type=ALL possible_keys=NULL key=NULL", "no scan of the table without an index")
	plan = explain("DueHeads", "[]", 400)
	require.Contains(t, plan, "key=watermill_outbox_failing", "the failed rows only")
}

// The danger of MySQL's locking reads: a "no earlier row of the key" test
// inside a SELECT ... FOR UPDATE SKIP LOCKED skips the earlier row another
// relay holds, and takes the later row for the key's head. With K-001
// locked elsewhere, the keyed batch takes nothing of K (its head is in
// flight) and J's head; the plain batch (a table that had no keyed row at
// its probe) takes K-002 flagged blocked, which the relay leaves as it
// was.
func TestRelayMySQLHeadLockedElsewhere(t *testing.T) {
	t.Parallel()
	b := mariaBundle(t)
	b.publish(t, "orders", keyed("K", 1), keyed("K", 2))
	b.publish(t, "orders", keyed("J", 1), keyed("J", 2))
	// Another relay's batch holds K-001 (by its id: a locking read by
	// uuid would scan, and lock, every row).
	var k1 int64
	require.NoError(t, seam.QueryRow(b.ctx, b.db, "SELECT id FROM "+b.tables.Outbox()+" WHERE uuid = 'K-001'", nil, &k1))
	other, err := b.db.BeginTx(b.ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	require.NoError(t, err)
	t.Cleanup(func() { _ = other.Rollback() })
	_, err = other.ExecContext(b.ctx, "SELECT id FROM "+b.tables.Outbox()+" WHERE id = ? FOR UPDATE", k1)
	require.NoError(t, err)

	store, err := outboxdb.New(b.schema())
	require.NoError(t, err)
	for _, keyedClaim := range []bool{true, false} {
		tx, err := b.db.BeginTx(b.ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
		require.NoError(t, err)
		rows, err := store.ClaimBatch(b.ctx, tx, outboxdb.Claim{Size: 100, Retry: 50, Keyed: keyedClaim, Window: 400})
		require.NoError(t, err)
		got := map[string]bool{}
		for _, r := range rows {
			got[r.UUID] = r.Blocked
		}
		if keyedClaim {
			require.Equal(t, map[string]bool{"J-001": false, "J-002": false}, got, "K's head is in flight elsewhere: nothing of K")
		} else {
			require.Equal(t, map[string]bool{"K-002": true, "J-001": false, "J-002": false}, got, "K-002 comes flagged blocked")
		}
		require.NoError(t, tx.Rollback())
	}

	// Through the relay: J goes, K waits for the other relay.
	rec := &recorder{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	n, err := relay.Flush(b.ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.NoError(t, other.Rollback())
	n, err = relay.Flush(b.ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	var uuids []string
	for _, d := range rec.delivered() {
		uuids = append(uuids, d.UUID)
	}
	require.Equal(t, []string{"J-001", "J-002", "K-001", "K-002"}, uuids)
}
