package outbox_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// orderedMsg is a message with this UUID and ordering key ("" for none).
func orderedMsg(uuid, key string) *message.Message {
	return msgid.SetOrderingKey(message.NewMessage(uuid, []byte(uuid)), key)
}

// blockedFigures are the fields of Pending about failed rows and blocked
// keys.
type blockedFigures struct{ Failing, Quarantined, BlockedKeys, Blocked int64 }

func (b bundle) blockedFigures(t *testing.T) blockedFigures {
	t.Helper()
	p, err := mustStore(t, b.schema()).Pending(b.ctx)
	require.NoError(t, err)
	return blockedFigures{p.Failing, p.Quarantined, p.BlockedKeys, p.Blocked}
}

// rowID is the id of the row of this UUID.
func (b bundle) rowID(t *testing.T, uuid string) int64 {
	t.Helper()
	var id int64
	err := seam.QueryRow(b.ctx, b.db, `SELECT id FROM `+b.tables.Outbox()+b.sql(` WHERE uuid = $1`, ` WHERE uuid = ?`), []any{uuid}, &id)
	require.NoError(t, err, "the row of UUID %s", uuid)
	return id
}

// keyWaiting is what a test reads of a Row: its UUID, ordering key and the
// rows waiting behind it.
type keyWaiting struct {
	UUID, Key string
	Waiting   int64
}

func keysOf(rows []outbox.Row) []keyWaiting {
	out := []keyWaiting{}
	for _, r := range rows {
		out = append(out, keyWaiting{r.UUID, r.OrderingKey, r.Waiting})
	}
	return out
}

// TestPendingStatsBlockedKeys: a failing or quarantined row with an
// ordering key blocks the later rows of its key. PendingStats counts the
// keys blocked and the rows that wait (not the failed rows themselves, nor
// the earlier rows of the key, nor the rows of other keys, nor a failed row
// without a key); FindRows and GetRow show each row's key and, for a failed
// one, the rows waiting behind it; RowFilter.OrderingKey selects a key's
// rows; discarding and requeueing the rows that block unblock their keys.
func TestPendingStatsBlockedKeys(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		db := b.schema()
		var rows []seedRow
		for _, r := range []struct{ uuid, key string }{
			{"A-1", "A"}, {"A-2", "A"}, {"A-3", "A"}, {"A-4", "A"},
			{"B-1", "B"}, {"B-2", "B"}, {"B-3", "B"},
			{"C-1", "C"}, {"C-2", "C"},
			{"free-1", ""}, {"free-2", ""},
		} {
			rows = append(rows, seedRow{Topic: "orders", UUID: r.uuid, Payload: r.uuid, OrderingKey: r.key})
		}
		b.seed(t, rows...)
		require.Equal(t, blockedFigures{}, b.blockedFigures(t), "no failed row: nothing blocked")

		// failing (A-4 waits behind A-2, and is counted as
		// failing, not blocked); B-1 quarantined; free-1, without a key,
		// failing: it blocks nothing.
		out := b.tables.Outbox()
		now := b.sql("now()", "UTC_TIMESTAMP(6)")
		b.exec(t, `UPDATE `+out+` SET failures = 2, next_attempt_at = `+now+b.sql(" + interval '1 hour'", " + INTERVAL 1 HOUR")+`, last_error = 'broker down'
WHERE uuid IN ('A-2', 'A-4', 'free-1')`)
		b.exec(t, `UPDATE `+out+` SET failures = 5, attempts = 5, quarantined_at = `+now+`, last_error = 'PRECONDITION_FAILED' WHERE uuid = 'B-1'`)
		require.Equal(t, blockedFigures{Failing: 3, Quarantined: 1, BlockedKeys: 2, Blocked: 3}, b.blockedFigures(t),
			"keys A and B blocked; waiting: A-3 (behind A-2), B-2 and B-3 (behind B-1)")
		p, err := mustStore(t, db).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, int64(11), p.Count, "blocked rows are pending rows")

		// The failed rows with their keys and the rows waiting behind them.
		page, err := mustStore(t, db).Find(b.ctx, outbox.RowFilter{State: outbox.StateAll}, outbox.Page{})
		require.NoError(t, err)
		require.Equal(t, []keyWaiting{{"A-2", "A", 2}, {"A-4", "A", 0}, {"B-1", "B", 2}, {"free-1", "", 0}}, keysOf(page.Rows))

		// By key: the default state (quarantined), failing, all; a key with
		// no failed row; paged.
		for _, c := range []struct {
			f    outbox.RowFilter
			want []keyWaiting
		}{
			{outbox.RowFilter{OrderingKey: "B"}, []keyWaiting{{"B-1", "B", 2}}},
			{outbox.RowFilter{OrderingKey: "A"}, []keyWaiting{}},
			{outbox.RowFilter{State: outbox.StateFailing, OrderingKey: "A"}, []keyWaiting{{"A-2", "A", 2}, {"A-4", "A", 0}}},
			{outbox.RowFilter{State: outbox.StateAll, OrderingKey: "A", Topic: "orders"}, []keyWaiting{{"A-2", "A", 2}, {"A-4", "A", 0}}},
			{outbox.RowFilter{State: outbox.StateAll, OrderingKey: "C"}, []keyWaiting{}},
			{outbox.RowFilter{State: outbox.StateAll, OrderingKey: "a"}, []keyWaiting{}},
		} {
			page, err := mustStore(t, db).Find(b.ctx, c.f, outbox.Page{})
			require.NoError(t, err)
			require.Equal(t, c.want, keysOf(page.Rows), "%+v", c.f)
			n, err := mustStore(t, db).Count(b.ctx, c.f)
			require.NoError(t, err)
			require.Equal(t, int64(len(c.want)), n, "%+v", c.f)
		}
		first, err := mustStore(t, db).Find(b.ctx, outbox.RowFilter{State: outbox.StateAll, OrderingKey: "A"}, outbox.Page{Limit: 1})
		require.NoError(t, err)
		require.Equal(t, []keyWaiting{{"A-2", "A", 2}}, keysOf(first.Rows))
		require.NotZero(t, first.Next)
		second, err := mustStore(t, db).Find(b.ctx, outbox.RowFilter{State: outbox.StateAll, OrderingKey: "A"}, outbox.Page{After: first.Next, Limit: 1})
		require.NoError(t, err)
		require.Equal(t, []keyWaiting{{"A-4", "A", 0}}, keysOf(second.Rows))
		require.Zero(t, second.Next)

		// GetRow: whatever the state; a row that never failed holds back
		// nothing.
		for uuid, want := range map[string]keyWaiting{
			"A-2": {"A-2", "A", 2}, "A-3": {"A-3", "A", 0}, "A-1": {"A-1", "A", 0}, "B-1": {"B-1", "B", 2}, "free-2": {"free-2", "", 0},
		} {
			r, err := mustStore(t, db).Get(b.ctx, b.rowID(t, uuid))
			require.NoError(t, err)
			require.Equal(t, []keyWaiting{want}, keysOf([]outbox.Row{r}), uuid)
		}

		// A key that no stored text can hold is refused, naming the field.
		_, err = mustStore(t, db).Find(b.ctx, outbox.RowFilter{OrderingKey: "A\x00"}, outbox.Page{})
		require.ErrorContains(t, err, "RowFilter.OrderingKey")

		// Discarding B's quarantined row unblocks B: its next row goes.
		require.NoError(t, mustStore(t, db).Discard(b.ctx, b.rowID(t, "B-1"), outbox.Expect{}))
		require.Equal(t, blockedFigures{Failing: 3, BlockedKeys: 1, Blocked: 1}, b.blockedFigures(t), "A-3 still waits behind A-2")

		// Requeueing A's failing rows (by key: free-1 is left as it is)
		// unblocks A.
		n, err := mustStore(t, db).RequeueMatching(b.ctx, outbox.RowFilter{State: outbox.StateFailing, OrderingKey: "A"})
		require.NoError(t, err)
		require.Equal(t, int64(2), n)
		require.Equal(t, blockedFigures{Failing: 1}, b.blockedFigures(t))

		// A key is a criterion: a discard of a key's quarantined rows is not
		// a discard of every quarantined row.
		b.exec(t, `UPDATE `+out+` SET failures = 1, attempts = 1, quarantined_at = `+now+` WHERE uuid IN ('C-1', 'A-4')`)
		require.Equal(t, blockedFigures{Failing: 1, Quarantined: 2, BlockedKeys: 2, Blocked: 1}, b.blockedFigures(t), "C-2 waits behind C-1; A-4 is A's last")
		n, err = mustStore(t, db).DiscardMatching(b.ctx, outbox.RowFilter{OrderingKey: "C"})
		require.NoError(t, err)
		require.Equal(t, int64(1), n)
		require.Equal(t, blockedFigures{Failing: 1, Quarantined: 1, BlockedKeys: 1}, b.blockedFigures(t))
	})
}

// TestRelayBlockedKeyShowsAndDiscardUnblocks: a row the broker refuses for
// good is quarantined by the relay and blocks its key; the figures and the
// row say so; once it is discarded, the relay publishes the key's rows and
// nothing is blocked any more.
func TestRelayBlockedKeyShowsAndDiscardUnblocks(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		db := b.schema()
		b.publish(t, "orders", orderedMsg("A-1", "A"), orderedMsg("A-2", "A"), orderedMsg("A-3", "A"),
			orderedMsg("B-1", "B"), orderedMsg("B-2", "B"))
		rec := &recorder{failUUID: "A-1"}
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: db, Publisher: rec, Logger: testenv.Logger(t), MaxAttempts: 1,
			IsPermanent:  func(err error) bool { return errors.Is(err, errUnpublishable) },
			ErrorBackoff: time.Microsecond, MaxErrorBackoff: time.Microsecond,
		})
		require.NoError(t, err)
		for range 3 {
			_, _ = relay.Flush(b.ctx)
		}
		var got []string
		for _, d := range rec.delivered() {
			got = append(got, d.UUID)
		}
		require.Equal(t, []string{"B-1", "B-2"}, got, "key B flows; A waits behind its quarantined first row")
		require.Equal(t, blockedFigures{Quarantined: 1, BlockedKeys: 1, Blocked: 2}, b.blockedFigures(t))

		page, err := mustStore(t, db).Find(b.ctx, outbox.RowFilter{OrderingKey: "A"}, outbox.Page{})
		require.NoError(t, err)
		require.Equal(t, []keyWaiting{{"A-1", "A", 2}}, keysOf(page.Rows))
		require.Contains(t, page.Rows[0].LastError, "too large for the broker")

		require.NoError(t, mustStore(t, db).Discard(b.ctx, page.Rows[0].ID, outbox.Expect{}))
		require.Equal(t, blockedFigures{}, b.blockedFigures(t), "discarded: the key is not blocked")
		for range 3 {
			_, _ = relay.Flush(b.ctx)
		}
		got = got[:0]
		for _, d := range rec.delivered() {
			got = append(got, d.UUID)
		}
		require.Equal(t, []string{"B-1", "B-2", "A-2", "A-3"}, got)
		require.Empty(t, b.rows(t))
	})
}

// TestOrderingKeySearchUsesIndexes: on 20,000 keyed rows, a search by
// ordering key and the rows waiting behind each failed row read
// outbox_001's ordering_key indexes, never the whole table.
func TestOrderingKeySearchUsesIndexes(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		const n = 20000
		// Row i: key "k<i % 500>"; failing when i % 400 = 3, quarantined
		// when i % 400 = 7.
		b.exec(t, `INSERT INTO `+b.tables.Outbox()+`
  (topic, uuid, payload, metadata, ordering_key, failures, attempts, last_error, quarantined_at)
SELECT 'topic-' || (i % 20), 'u-' || i, convert_to('{}', 'UTF8'), '{}'::jsonb, 'k' || (i % 500),
  CASE WHEN i % 400 IN (3, 7) THEN 2 ELSE 0 END,
  CASE WHEN i % 400 = 7 THEN 2 ELSE 0 END,
  CASE WHEN i % 400 IN (3, 7) THEN 'refused' END,
  CASE WHEN i % 400 = 7 THEN now() END
FROM generate_series(1, $1::int) i`, n)
		b.exec(t, `ANALYZE `+b.tables.Outbox())
		db := b.schema()
		for _, c := range []struct {
			name string
			f    outbox.RowFilter
		}{
			{"failing by key", outbox.RowFilter{State: outbox.StateFailing, OrderingKey: "k3"}},
			{"all by key", outbox.RowFilter{State: outbox.StateAll, OrderingKey: "k7"}},
			{"quarantined page", outbox.RowFilter{}},
		} {
			query, args := outbox.FindSQL(db, c.f, 0, 101)
			rs, err := b.db.QueryContext(b.ctx, query, args...)
			require.NoError(t, err)
			rows := 0
			for rs.Next() {
				rows++
			}
			require.NoError(t, seam.Close(rs))
			require.NotZero(t, rows, c.name)
			plan := testenv.Explain(b.ctx, t, b.db, "EXPLAIN (ANALYZE, COSTS OFF) "+query, args...)
			t.Logf("%s: %s", c.name, plan[strings.LastIndex(plan, "Execution Time"):])
			require.NotContains(t, plan, "Seq Scan", "%s:\n%s", c.name, plan)
			require.Contains(t, plan, fmt.Sprintf("%s_ordering_key", b.tables.OutboxTable), "%s: the rows waiting are counted on the index:\n%s", c.name, plan)
		}
	})
}
