package outbox_test

// The operator's surface of quarantined (and failing) rows: find by each
// criterion, page, read one, requeue and discard one or by filter, against
// the real relay, with both drivers.

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// seedRow is an outbox row written as the relay would have left it.
type seedRow struct {
	Topic, UUID, Payload string
	Metadata             map[string]string
	// State is "" for a row that never failed, outbox.StateQuarantined or
	// outbox.StateFailing.
	State         outbox.RowState
	LastError     string
	QuarantinedAt time.Time // StateQuarantined: defaults to now
	OrderingKey   string    // "" for none
}

// relays is false where the relay does not run yet: MySQL, until the
// relay's MySQL statements are merged (issue 31). The tests of the
// operator's surface check its effect on the rows on every engine, and
// that the relay publishes what it requeued where the relay runs.
func (b bundle) relays() bool { return !b.mysql() }

// takeDue deletes the rows a relay would publish now (no quarantine, no
// backoff pending) and returns them as "topic/uuid", in id order: the
// relay's effect where it does not run yet (MySQL; see relays).
func (b bundle) takeDue(t testing.TB) []string {
	t.Helper()
	require.True(t, b.mysql(), "the relay runs on PostgreSQL")
	rs, err := b.db.QueryContext(b.ctx, `SELECT id, topic, uuid FROM `+b.tables.Outbox()+`
WHERE quarantined_at IS NULL AND (next_attempt_at IS NULL OR next_attempt_at <= UTC_TIMESTAMP(6)) ORDER BY id`)
	require.NoError(t, err)
	var ids []int64
	var out []string
	for rs.Next() {
		var id int64
		var topic, uuid string
		require.NoError(t, rs.Scan(&id, &topic, &uuid))
		ids = append(ids, id)
		out = append(out, topic+"/"+uuid)
	}
	require.NoError(t, seam.Close(rs))
	for _, id := range ids {
		require.Equal(t, int64(1), b.exec(t, `DELETE FROM `+b.tables.Outbox()+` WHERE id = ?`, id))
	}
	return out
}

// seed writes rows in order and returns their ids.
func (b bundle) seed(t testing.TB, rows ...seedRow) []int64 {
	t.Helper()
	if !b.mysql() {
		return b.seedIn(t, b.db, rows...)
	}
	tx := b.begin(t) // LAST_INSERT_ID() is the connection's
	ids := b.seedIn(t, tx, rows...)
	require.NoError(t, tx.Commit())
	return ids
}

// seedIn is seed through q, a transaction on MySQL (or a connection of
// its own: each id is read back with LAST_INSERT_ID()).
func (b bundle) seedIn(t testing.TB, q wsql.ContextExecutor, rows ...seedRow) []int64 {
	t.Helper()
	ids := make([]int64, len(rows))
	for i, r := range rows {
		meta, err := json.Marshal(r.Metadata)
		require.NoError(t, err)
		if r.Metadata == nil {
			meta = []byte("{}")
		}
		var failures, permanent int
		var next, quarantined *time.Time
		switch r.State {
		case outbox.StateQuarantined:
			failures, permanent = 4, 3
			at := r.QuarantinedAt
			if at.IsZero() {
				at = time.Now()
			}
			quarantined = &at
		case outbox.StateFailing:
			failures = 2
			at := time.Now().Add(time.Hour)
			next = &at
		}
		args := []any{r.Topic, r.UUID, []byte(r.Payload), string(meta), failures, permanent, r.LastError, next, quarantined, r.OrderingKey}
		if b.mysql() {
			_, err := q.ExecContext(b.ctx, `INSERT INTO `+b.tables.Outbox()+`
  (topic, uuid, payload, metadata, created_at, failures, attempts, last_error, next_attempt_at, quarantined_at, ordering_key)
VALUES (?, ?, ?, ?, UTC_TIMESTAMP(6), ?, ?, NULLIF(?, ''), ?, ?, NULLIF(?, ''))`, args...)
			require.NoError(t, err)
			require.NoError(t, seam.QueryRow(b.ctx, q, `SELECT LAST_INSERT_ID()`, nil, &ids[i]))
			continue
		}
		require.NoError(t, seam.QueryRow(b.ctx, q, `INSERT INTO `+b.tables.Outbox()+`
  (topic, uuid, payload, metadata, failures, attempts, last_error, next_attempt_at, quarantined_at, ordering_key)
VALUES ($1, $2, $3, $4::jsonb, $5, $6, NULLIF($7, ''), $8, $9, NULLIF($10, '')) RETURNING id`, args, &ids[i]))
	}
	return ids
}

// seedBulk writes n quarantined rows of topic with metadata {"bulk": tag}
// in one statement.
func (b bundle) seedBulk(t testing.TB, topic, tag string, n int) {
	t.Helper()
	if b.mysql() {
		// n rows from 1 to n, counted in the digits of a cross join (MySQL
		// 8 bounds a recursive CTE at 1000 rows).
		require.Equal(t, int64(n), b.exec(t, `INSERT INTO `+b.tables.Outbox()+`
  (topic, uuid, payload, metadata, created_at, failures, attempts, last_error, quarantined_at)
SELECT ?, CONCAT(?, '-', g.n), X'7b7d', JSON_OBJECT('bulk', ?), UTC_TIMESTAMP(6), 3, 3, 'refused (test)', UTC_TIMESTAMP(6)
FROM (SELECT 1 + a.d + 10 * b.d + 100 * c.d + 1000 * e.d AS n
      FROM (SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5
            UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) a,
           (SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5
            UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) b,
           (SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5
            UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) c,
           (SELECT 0 d UNION ALL SELECT 1 UNION ALL SELECT 2 UNION ALL SELECT 3 UNION ALL SELECT 4 UNION ALL SELECT 5
            UNION ALL SELECT 6 UNION ALL SELECT 7 UNION ALL SELECT 8 UNION ALL SELECT 9) e) g
WHERE g.n <= ? ORDER BY g.n`, topic, tag, tag, n))
		return
	}
	require.Equal(t, int64(n), b.exec(t, `INSERT INTO `+b.tables.Outbox()+`
  (topic, uuid, payload, metadata, failures, attempts, last_error, quarantined_at)
SELECT $1, $2 || '-' || g, '\x7b7d', jsonb_build_object('bulk', $2::text), 3, 3, 'refused (test)', now()
FROM generate_series(1, $3::int) g`, topic, tag, n))
}

func rowIDs(rows []outbox.Row) []int64 {
	ids := []int64{}
	for _, r := range rows {
		ids = append(ids, r.ID)
	}
	return ids
}

// Each criterion of RowFilter alone and combined, in each state; CountRows
// agrees with FindRows; a row's fields as stored.
func TestFindRowsFilters(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		db := b.schema()
		now := time.Now()
		ids := b.seed(t,
			seedRow{Topic: "orders", UUID: "h1", Payload: `{"n":0}`, Metadata: map[string]string{"order_id": "o-1"}},
			seedRow{Topic: "orders", UUID: "q1", Payload: `{"n":1}`, Metadata: map[string]string{"order_id": "o-1", "tenant": "acme"},
				State: outbox.StateQuarantined, LastError: "message q1 refused: PRECONDITION_FAILED", QuarantinedAt: now.Add(-3 * time.Hour)},
			seedRow{Topic: "orders", UUID: "f1", Metadata: map[string]string{"order_id": "o-1"}, State: outbox.StateFailing, LastError: "broker down"},
			seedRow{Topic: "orders", UUID: "q2", Metadata: map[string]string{"order_id": "o-2", "tenant": "acme"},
				State: outbox.StateQuarantined, LastError: "message too large for the broker", QuarantinedAt: now.Add(-2 * time.Hour)},
			seedRow{Topic: "invoices", UUID: "q3", Metadata: map[string]string{"order_id": "o-1", "tenant": "globex"},
				State: outbox.StateQuarantined, LastError: "header x-big over 255 bytes", QuarantinedAt: now.Add(-time.Hour)},
			seedRow{Topic: "invoices", UUID: "fan", State: outbox.StateFailing, LastError: "connection reset"},
			seedRow{Topic: "invoices", UUID: "fan", State: outbox.StateQuarantined, LastError: "again: precondition_failed", QuarantinedAt: now.Add(-30 * time.Minute)},
		)
		h1, q1, f1, q2, q3, f2, q4 := ids[0], ids[1], ids[2], ids[3], ids[4], ids[5], ids[6]

		for _, c := range []struct {
			name string
			f    outbox.RowFilter
			want []int64
		}{
			{"zero filter: quarantined", outbox.RowFilter{}, []int64{q1, q2, q3, q4}},
			{"state quarantined", outbox.RowFilter{State: outbox.StateQuarantined}, []int64{q1, q2, q3, q4}},
			{"state failing", outbox.RowFilter{State: outbox.StateFailing}, []int64{f1, f2}},
			{"state all", outbox.RowFilter{State: outbox.StateAll}, []int64{q1, f1, q2, q3, f2, q4}},
			{"ids", outbox.RowFilter{IDs: []int64{q2, f1, h1, 1 << 40}}, []int64{q2}},
			{"ids, all", outbox.RowFilter{State: outbox.StateAll, IDs: []int64{q2, f1, h1}}, []int64{f1, q2}},
			{"topic", outbox.RowFilter{Topic: "invoices"}, []int64{q3, q4}},
			{"uuid", outbox.RowFilter{UUID: "fan"}, []int64{q4}},
			{"uuid, all", outbox.RowFilter{State: outbox.StateAll, UUID: "fan"}, []int64{f2, q4}},
			{"reason ignores case", outbox.RowFilter{Reason: "precondition_FAILED"}, []int64{q1, q4}},
			{"reason, all", outbox.RowFilter{State: outbox.StateAll, Reason: "o"}, []int64{q1, f1, q2, q3, f2, q4}},
			{"since", outbox.RowFilter{QuarantinedSince: now.Add(-150 * time.Minute)}, []int64{q2, q3, q4}},
			{"before", outbox.RowFilter{QuarantinedBefore: now.Add(-90 * time.Minute)}, []int64{q1, q2}},
			{"range", outbox.RowFilter{QuarantinedSince: now.Add(-150 * time.Minute), QuarantinedBefore: now.Add(-90 * time.Minute)}, []int64{q2}},
			{"range, all: failing rows have no quarantine time", outbox.RowFilter{State: outbox.StateAll, QuarantinedSince: now.Add(-4 * time.Hour)}, []int64{q1, q2, q3, q4}},
			{"metadata field", outbox.RowFilter{Metadata: map[string]string{"order_id": "o-1"}}, []int64{q1, q3}},
			{"metadata fields", outbox.RowFilter{Metadata: map[string]string{"order_id": "o-1", "tenant": "acme"}}, []int64{q1}},
			{"metadata, all", outbox.RowFilter{State: outbox.StateAll, Metadata: map[string]string{"order_id": "o-1"}}, []int64{q1, f1, q3}},
			{"metadata, failing", outbox.RowFilter{State: outbox.StateFailing, Metadata: map[string]string{"order_id": "o-1"}}, []int64{f1}},
			{"metadata no match", outbox.RowFilter{Metadata: map[string]string{"order_id": "o-9"}}, []int64{}},
			{"metadata value must match exactly", outbox.RowFilter{Metadata: map[string]string{"order_id": "o"}}, []int64{}},
			{"combined", outbox.RowFilter{Topic: "orders", Reason: "TOO LARGE", Metadata: map[string]string{"tenant": "acme"}}, []int64{q2}},
		} {
			page, err := mustStore(t, db).Find(b.ctx, c.f, outbox.Page{})
			require.NoError(t, err, c.name)
			require.Equal(t, c.want, rowIDs(page.Rows), c.name)
			require.Zero(t, page.Next, c.name)
			n, err := mustStore(t, db).Count(b.ctx, c.f)
			require.NoError(t, err, c.name)
			require.Equal(t, int64(len(c.want)), n, c.name)
		}

		// A row as stored, through FindRows and GetRow.
		page, err := mustStore(t, db).Find(b.ctx, outbox.RowFilter{UUID: "q1"}, outbox.Page{})
		require.NoError(t, err)
		require.Len(t, page.Rows, 1)
		r := page.Rows[0]
		require.Equal(t, q1, r.ID)
		require.Equal(t, "orders", r.Topic)
		require.Equal(t, "q1", r.UUID)
		require.Nil(t, r.Payload, "a page reads no payload")
		require.Equal(t, len(`{"n":1}`), r.PayloadSize)
		require.Equal(t, map[string]string{"order_id": "o-1", "tenant": "acme"}, r.Metadata)
		require.JSONEq(t, `{"order_id": "o-1", "tenant": "acme"}`, string(r.RawMetadata))
		require.WithinDuration(t, now, r.CreatedAt, time.Minute)
		require.True(t, r.Quarantined())
		require.WithinDuration(t, now.Add(-3*time.Hour), *r.QuarantinedAt, time.Millisecond)
		require.Equal(t, 4, r.Failures)
		require.Equal(t, 3, r.PermanentFailures)
		require.Nil(t, r.NextAttemptAt)
		require.Equal(t, "message q1 refused: PRECONDITION_FAILED", r.LastError)
		got, err := mustStore(t, db).Get(b.ctx, q1)
		require.NoError(t, err)
		require.Equal(t, `{"n":1}`, string(got.Payload))
		got.Payload = nil
		require.Equal(t, r, got, "GetRow reads the row FindRows read, with its payload")

		failing, err := mustStore(t, db).Get(b.ctx, f1)
		require.NoError(t, err)
		require.False(t, failing.Quarantined())
		require.Equal(t, 2, failing.Failures)
		require.Zero(t, failing.PermanentFailures)
		require.NotNil(t, failing.NextAttemptAt)
		require.Equal(t, "broker down", failing.LastError)

		// GetRow reads any row, even one that never failed, and one whose
		// metadata the relay cannot read.
		b.exec(t, `UPDATE `+b.tables.Outbox()+b.sql(` SET metadata = '{"n": 1}' WHERE id = $1`, ` SET metadata = '{"n": 1}' WHERE id = ?`), h1)
		healthy, err := mustStore(t, db).Get(b.ctx, h1)
		require.NoError(t, err)
		require.False(t, healthy.Quarantined())
		require.Zero(t, healthy.Failures)
		require.Empty(t, healthy.LastError)
		require.Nil(t, healthy.Metadata, "not a JSON object of strings")
		require.JSONEq(t, `{"n": 1}`, string(healthy.RawMetadata))

		_, err = mustStore(t, db).Get(b.ctx, 1<<40)
		require.ErrorIs(t, err, outbox.ErrRowNotFound)

		missing := b.schema()
		missing.OutboxTable = "missing"
		_, err = mustStore(t, missing).Find(b.ctx, outbox.RowFilter{}, outbox.Page{})
		require.ErrorIs(t, err, sqlschema.ErrNotMigrated)
		_, err = mustStore(t, missing).Count(b.ctx, outbox.RowFilter{})
		require.ErrorIs(t, err, sqlschema.ErrNotMigrated)
		_, err = mustStore(t, missing).RequeueMatching(b.ctx, outbox.RowFilter{})
		require.ErrorIs(t, err, sqlschema.ErrNotMigrated)
	})
}

// FindRows reads no payload, whatever its size (PayloadSize is the whole
// size); GetRowPrefix reads at most its first bytes (the whole payload when
// it is shorter, none with 0); GetRow reads it whole.
func TestGetRowPrefix(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		db := b.schema()
		large := strings.Repeat("0123456789abcdef", 1<<16) // 1 MiB: stored out of line
		ids := b.seed(t,
			seedRow{Topic: "big", UUID: "large", Payload: large, State: outbox.StateQuarantined, LastError: "too large"},
			seedRow{Topic: "big", UUID: "small", Payload: `{"n":1}`, State: outbox.StateQuarantined, LastError: "too large"},
			seedRow{Topic: "big", UUID: "empty", Payload: "", State: outbox.StateQuarantined, LastError: "too large"})

		page, err := mustStore(t, db).Find(b.ctx, outbox.RowFilter{Topic: "big"}, outbox.Page{})
		require.NoError(t, err)
		require.Equal(t, ids, rowIDs(page.Rows))
		for i, want := range []int{len(large), len(`{"n":1}`), 0} {
			require.Nil(t, page.Rows[i].Payload, "a page reads no payload")
			require.Equal(t, want, page.Rows[i].PayloadSize)
		}

		r, err := mustStore(t, db).GetPrefix(b.ctx, ids[0], 10)
		require.NoError(t, err)
		require.Equal(t, "0123456789", string(r.Payload))
		require.Equal(t, len(large), r.PayloadSize)
		require.Equal(t, "large", r.UUID)
		require.True(t, r.Quarantined())

		r, err = mustStore(t, db).GetPrefix(b.ctx, ids[1], 10)
		require.NoError(t, err)
		require.Equal(t, `{"n":1}`, string(r.Payload), "shorter than the bound: whole")
		require.Equal(t, len(`{"n":1}`), r.PayloadSize)

		r, err = mustStore(t, db).GetPrefix(b.ctx, ids[0], 0)
		require.NoError(t, err)
		require.Empty(t, r.Payload)
		require.Equal(t, len(large), r.PayloadSize)

		r, err = mustStore(t, db).GetPrefix(b.ctx, ids[2], 10)
		require.NoError(t, err)
		require.Empty(t, r.Payload)
		require.Zero(t, r.PayloadSize)

		r, err = mustStore(t, db).Get(b.ctx, ids[0])
		require.NoError(t, err)
		require.Equal(t, large, string(r.Payload))
		require.Equal(t, len(large), r.PayloadSize)

		_, err = mustStore(t, db).GetPrefix(b.ctx, ids[0], -1)
		require.ErrorContains(t, err, "maxPayload is -1")
		_, err = mustStore(t, db).GetPrefix(b.ctx, 1<<40, 10)
		require.ErrorIs(t, err, outbox.ErrRowNotFound)
	})
}

// With MaxScan, a read by Reason (no index holds the error's text) is
// refused (ErrTooBroad) when the other conditions select more than MaxScan
// rows, and answers as without it otherwise; with MaxCount, a count of
// more rows is refused. The bulk operations ignore both.
func TestRowReadsBounded(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		db := b.schema()
		ids := b.seed(t,
			seedRow{Topic: "a", UUID: "q1", State: outbox.StateQuarantined, LastError: "PRECONDITION_FAILED", Metadata: map[string]string{"order_id": "o-1"}},
			seedRow{Topic: "a", UUID: "q2", State: outbox.StateQuarantined, LastError: "precondition_failed"},
			seedRow{Topic: "a", UUID: "q3", State: outbox.StateQuarantined, LastError: "no route"},
			seedRow{Topic: "b", UUID: "q4", State: outbox.StateQuarantined, LastError: "precondition_failed"},
			seedRow{Topic: "a", UUID: "f1", State: outbox.StateFailing, LastError: "precondition_failed"})

		tooBroad := outbox.RowFilter{Reason: "precondition", MaxScan: 3}
		require.True(t, tooBroad.Scans())
		_, err := mustStore(t, db).Find(b.ctx, tooBroad, outbox.Page{})
		require.ErrorIs(t, err, outbox.ErrTooBroad)
		require.ErrorContains(t, err, "would be checked on more than 3 rows")
		_, err = mustStore(t, db).Count(b.ctx, tooBroad)
		require.ErrorIs(t, err, outbox.ErrTooBroad)
		_, err = mustStore(t, db).CountAsOf(b.ctx, tooBroad)
		require.ErrorIs(t, err, outbox.ErrTooBroad)

		for _, c := range []struct {
			f    outbox.RowFilter
			want []int64
		}{
			{outbox.RowFilter{Topic: "a", Reason: "precondition"}, ids[:2]},
			{outbox.RowFilter{Reason: "PRECONDITION", Metadata: map[string]string{"order_id": "o-1"}}, ids[:1]},
			{outbox.RowFilter{State: outbox.StateFailing, Reason: "precondition"}, ids[4:]},
			{outbox.RowFilter{}, ids[:4]},
		} {
			f := c.f
			f.MaxScan = 3
			page, err := mustStore(t, db).Find(b.ctx, f, outbox.Page{})
			require.NoError(t, err, "%+v", f)
			require.Equal(t, c.want, rowIDs(page.Rows), "%+v", f)
			n, err := mustStore(t, db).Count(b.ctx, f)
			require.NoError(t, err)
			require.EqualValues(t, len(c.want), n)
			rc, err := mustStore(t, db).CountAsOf(b.ctx, f)
			require.NoError(t, err)
			require.EqualValues(t, len(c.want), rc.Count)
			require.Equal(t, c.want[len(c.want)-1], rc.MaxID)
		}

		rc, err := mustStore(t, db).CountAsOf(b.ctx, outbox.RowFilter{MaxCount: 4})
		require.NoError(t, err)
		require.Equal(t, outbox.RowCount{Count: 4, AsOf: rc.AsOf, MaxID: ids[3]}, rc)
		_, err = mustStore(t, db).CountAsOf(b.ctx, outbox.RowFilter{State: outbox.StateAll, MaxCount: 4})
		require.ErrorIs(t, err, outbox.ErrTooBroad)
		require.ErrorContains(t, err, "more than 4 rows match")
		_, err = mustStore(t, db).Count(b.ctx, outbox.RowFilter{State: outbox.StateAll, MaxCount: 4})
		require.ErrorIs(t, err, outbox.ErrTooBroad)
		_, err = mustStore(t, db).Count(b.ctx, outbox.RowFilter{MaxScan: -1})
		require.ErrorContains(t, err, "MaxScan (-1)")

		n, err := mustStore(t, db).RequeueMatching(b.ctx, outbox.RowFilter{Reason: "precondition", MaxScan: 1, MaxCount: 1})
		require.NoError(t, err)
		require.EqualValues(t, 3, n)
	})
}

// Pages in id order by keyset: every quarantined row once, the healthy rows
// between them never, Next 0 on the last page.
func TestFindPaging(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		db := b.schema()
		var want []int64
		for i := range 25 {
			ids := b.seed(t,
				seedRow{Topic: "t", UUID: fmt.Sprint("h", i)},
				seedRow{Topic: "t", UUID: fmt.Sprint("q", i), State: outbox.StateQuarantined, LastError: "refused"})
			want = append(want, ids[1])
		}
		for _, c := range []struct{ limit, pages int }{{10, 3}, {5, 5}, {25, 1}, {0, 1}, {1, 25}} {
			var got []int64
			p := outbox.Page{Limit: c.limit}
			pages := 0
			for {
				page, err := mustStore(t, db).Find(b.ctx, outbox.RowFilter{}, p)
				require.NoError(t, err)
				pages++
				require.NotEmpty(t, page.Rows, "limit %d, page %d", c.limit, pages)
				got = append(got, rowIDs(page.Rows)...)
				if page.Next == "" {
					break
				}
				require.Equal(t, strconv.FormatInt(page.Rows[len(page.Rows)-1].ID, 10), page.Next)
				p.After = page.Next
			}
			require.Equal(t, want, got, "limit %d", c.limit)
			require.Equal(t, c.pages, pages, "limit %d", c.limit)
		}
		page, err := mustStore(t, db).Find(b.ctx, outbox.RowFilter{}, outbox.Page{After: strconv.FormatInt(want[len(want)-1], 10)})
		require.NoError(t, err)
		require.Empty(t, page.Rows)
		require.Zero(t, page.Next)
	})
}

// Invalid input is refused before any query, with the field named.
func TestRowFilterValidation(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	db := sqlschema.DB{Conn: txConn{}} // never reached
	find := func(f outbox.RowFilter) error {
		_, err := mustStore(t, db).Find(ctx, f, outbox.Page{})
		return err
	}
	tooMany := make([]int64, outbox.MaxFilterIDs+1)
	for i := range tooMany {
		tooMany[i] = int64(i + 1)
	}
	now := time.Now()
	for _, c := range []struct {
		name string
		err  error
		want string
	}{
		{"state", find(outbox.RowFilter{State: "parked"}), `RowFilter.State is "parked": want "quarantined" (the default), "failing" or "all"`},
		{"id zero", find(outbox.RowFilter{IDs: []int64{3, 0}}), "RowFilter.IDs has 0: ids are positive"},
		{"too many ids", find(outbox.RowFilter{IDs: tooMany}), "RowFilter.IDs names 10001 rows, at most 10000"},
		{"topic", find(outbox.RowFilter{Topic: "a\x00b"}), "RowFilter.Topic contains a NUL byte"},
		{"uuid", find(outbox.RowFilter{UUID: "\xff"}), "RowFilter.UUID not valid UTF-8"},
		{"reason", find(outbox.RowFilter{Reason: "\x00"}), "RowFilter.Reason contains a NUL byte"},
		{"metadata key", find(outbox.RowFilter{Metadata: map[string]string{"": "x"}}), "RowFilter.Metadata has an empty key"},
		{"metadata value", find(outbox.RowFilter{Metadata: map[string]string{"k": "\xff"}}), `RowFilter.Metadata["k"]: value not valid UTF-8`},
		{"empty range", find(outbox.RowFilter{QuarantinedSince: now, QuarantinedBefore: now}), "is not before QuarantinedBefore"},
		{"range of failing rows", find(outbox.RowFilter{State: outbox.StateFailing, QuarantinedBefore: now}), "failing rows are not quarantined"},
		{"limit", func() error {
			_, err := mustStore(t, db).Find(ctx, outbox.RowFilter{}, outbox.Page{Limit: outbox.MaxRowLimit + 1})
			return err
		}(),
			"outbox: Find: Page.Limit is 1001: it must be between 1 and 1000 (0 for 100)"},
		{"negative limit", func() error {
			_, err := mustStore(t, db).Find(ctx, outbox.RowFilter{}, outbox.Page{Limit: -1})
			return err
		}(), "outbox: Find: Page.Limit is -1"},
		{"after", func() error {
			_, err := mustStore(t, db).Find(ctx, outbox.RowFilter{}, outbox.Page{After: "-1"})
			return err
		}(), `outbox: Find: Page.After is "-1"`},
		{"cursor", func() error {
			_, err := mustStore(t, db).Find(ctx, outbox.RowFilter{}, outbox.Page{After: "x"})
			return err
		}(), `outbox: Find: Page.After is "x": use "" for the first page, RowPage.Next for the next`},
		{"count", func() error { _, err := mustStore(t, db).Count(ctx, outbox.RowFilter{State: "x"}); return err }(), "outbox: Count: RowFilter.State"},
		{"requeue matching", func() error {
			_, err := mustStore(t, db).RequeueMatching(ctx, outbox.RowFilter{IDs: []int64{-1}})
			return err
		}(), "outbox: RequeueMatching: RowFilter.IDs has -1"},
		{"discard failing", func() error {
			_, err := mustStore(t, db).DiscardMatching(ctx, outbox.RowFilter{State: outbox.StateFailing, Topic: "t"})
			return err
		}(), `RowFilter.State is "failing", but only quarantined rows can be discarded`},
		{"discard all", func() error {
			_, err := mustStore(t, db).DiscardMatching(ctx, outbox.RowFilter{State: outbox.StateAll, Topic: "t"})
			return err
		}(), `RowFilter.State is "all", but only quarantined rows can be discarded`},
		{"discard everything", func() error { _, err := mustStore(t, db).DiscardMatching(ctx, outbox.RowFilter{}); return err }(),
			"the RowFilter names no criterion and AsOf is not set, so it selects every quarantined row"},
		{"max id", find(outbox.RowFilter{MaxID: -3}), "RowFilter.MaxID is -3: ids are positive"},
		{"get id", func() error { _, err := mustStore(t, db).Get(ctx, 0); return err }(), "outbox: Get: row id 0: ids are positive"},
		{"requeue id", mustStore(t, db).Requeue(ctx, -2, outbox.Expect{}), "outbox: Requeue: row id -2: ids are positive"},
		{"discard id", mustStore(t, db).Discard(ctx, 0, outbox.Expect{}), "outbox: Discard: row id 0: ids are positive"},
		{"no conn", func() error { _, err := outbox.NewStore(sqlschema.DB{}); return err }(), "outbox: NewStore: DB.Conn is nil"},
		{"bad table", func() error {
			_, err := outbox.NewStore(sqlschema.DB{Conn: txConn{}, OutboxTable: "a-b"})
			return err
		}(), "DB.OutboxTable"},
	} {
		require.ErrorContains(t, c.err, c.want, c.name)
	}
}

// A row the broker refuses for good is quarantined by the relay, found by
// its business id, requeued once the cause is fixed, and published once
// with its UUID, payload and metadata. Rows not quarantined are refused by
// id, unchanged.
func TestRequeueOne(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		db := b.schema()
		var msgs []*message.Message
		for i := 1; i <= 3; i++ {
			m := message.NewMessage(fmt.Sprint("msg-", i), []byte(fmt.Sprintf(`{"order":%d}`, i)))
			m.Metadata.Set("order_id", fmt.Sprint("o-", i))
			msgs = append(msgs, m)
		}
		b.publish(t, "orders", msgs...)
		rec := &recorder{failUUID: "msg-2"}
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: db, Publisher: rec, Logger: testenv.Logger(t), MaxAttempts: 1,
			IsPermanent:  func(err error) bool { return errors.Is(err, errUnpublishable) },
			ErrorBackoff: time.Microsecond, MaxErrorBackoff: time.Microsecond,
		})
		require.NoError(t, err)
		n, err := relay.Flush(b.ctx)
		require.ErrorIs(t, err, errUnpublishable)
		require.Equal(t, 2, n, "the rows around the refused one")
		require.Equal(t, []string{"orders/msg-2"}, b.quarantined(t))
		n, err = relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Zero(t, n, "quarantined: skipped")

		page, err := mustStore(t, db).Find(b.ctx, outbox.RowFilter{Metadata: map[string]string{"order_id": "o-2"}}, outbox.Page{})
		require.NoError(t, err)
		require.Len(t, page.Rows, 1)
		row := page.Rows[0]
		require.Equal(t, "msg-2", row.UUID)
		require.Contains(t, row.LastError, "too large for the broker")

		rec.mu.Lock()
		rec.failUUID = "" // the cause is fixed
		rec.mu.Unlock()
		require.NoError(t, mustStore(t, db).Requeue(b.ctx, row.ID, outbox.Expect{}))
		requeued, err := mustStore(t, db).Get(b.ctx, row.ID)
		require.NoError(t, err)
		require.False(t, requeued.Quarantined())
		require.Zero(t, requeued.Failures)
		require.Zero(t, requeued.PermanentFailures)
		require.Nil(t, requeued.NextAttemptAt)
		require.Empty(t, requeued.LastError)
		n, err = relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Equal(t, 1, n)
		got := rec.delivered()
		require.Len(t, got, 3)
		require.Equal(t, delivered{Topic: "orders", UUID: "msg-2", Payload: `{"order":2}`, Metadata: map[string]string{"order_id": "o-2"}}, got[2])
		require.Zero(t, b.pending(t, b.db))

		// Requeued and relayed: gone.
		require.ErrorIs(t, mustStore(t, db).Requeue(b.ctx, row.ID, outbox.Expect{}), outbox.ErrRowNotFound)
		require.ErrorIs(t, mustStore(t, db).Discard(b.ctx, row.ID, outbox.Expect{}), outbox.ErrRowNotFound)

		// A failing row and a row that never failed are the relay's: refused
		// by id, unchanged.
		rec.setFailTopic("orders")
		b.publish(t, "orders", message.NewMessage("failing", nil))
		_, err = relay.Flush(b.ctx)
		require.ErrorIs(t, err, errBrokerDown)
		b.publish(t, "orders", message.NewMessage("fresh", nil))
		rows := b.rows(t)
		require.Len(t, rows, 2)
		failingID, freshID := rows[0].ID, rows[1].ID
		err = mustStore(t, db).Requeue(b.ctx, failingID, outbox.Expect{})
		require.ErrorIs(t, err, outbox.ErrNotQuarantined)
		require.ErrorContains(t, err, "it is failing, and the relay retries it after its backoff")
		require.ErrorIs(t, mustStore(t, db).Discard(b.ctx, failingID, outbox.Expect{}), outbox.ErrNotQuarantined)
		err = mustStore(t, db).Requeue(b.ctx, freshID, outbox.Expect{})
		require.ErrorIs(t, err, outbox.ErrNotQuarantined)
		require.ErrorContains(t, err, "no failure record")
		require.ErrorIs(t, mustStore(t, db).Discard(b.ctx, freshID, outbox.Expect{}), outbox.ErrNotQuarantined)
		failing, err := mustStore(t, db).Get(b.ctx, failingID)
		require.NoError(t, err)
		require.Equal(t, 1, failing.Failures, "unchanged")
		require.NotNil(t, failing.NextAttemptAt)
		require.Len(t, b.rows(t), 2, "nothing discarded")
	})
}

// Requeue and RequeueMatching wake a listening relay: with an hour's poll
// interval, the requeued rows are published at once.
func TestRequeueWakesTheRelay(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		ids := b.seed(t,
			seedRow{Topic: "t", UUID: "q", State: outbox.StateQuarantined, LastError: "refused"},
			seedRow{Topic: "t", UUID: "q2", State: outbox.StateQuarantined, LastError: "refused"})
		rec := &recorder{}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, PollInterval: slowPoll, Logger: testenv.Logger(t),
			ListenConnString: testenv.ListenConnString()})
		require.NoError(t, err)
		runRelay(t, relay)
		waitListening(t, relay)
		time.Sleep(100 * time.Millisecond) // past the catch-up polls of its first batch
		require.Zero(t, rec.count(), "quarantined: skipped")
		require.NoError(t, mustStore(t, b.schema()).Requeue(b.ctx, ids[0], outbox.Expect{}))
		waitDelivered(t, rec, 1, 5*time.Second, "requeued row")
		time.Sleep(100 * time.Millisecond)
		n, err := mustStore(t, b.schema()).RequeueMatching(b.ctx, outbox.RowFilter{UUID: "q2"})
		require.NoError(t, err)
		require.Equal(t, int64(1), n)
		waitDelivered(t, rec, 2, 5*time.Second, "row requeued by filter")
	})
}

// Two operators requeue one row at once: one requeues it, the other is told
// it is no longer quarantined.
func TestRequeueConcurrently(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		for i := range 5 {
			ids := b.seed(t, seedRow{Topic: "t", UUID: fmt.Sprint("q", i), State: outbox.StateQuarantined, LastError: "refused"})
			errs := make([]error, 2)
			var wg sync.WaitGroup
			for j := range errs {
				wg.Go(func() { errs[j] = mustStore(t, b.schema()).Requeue(b.ctx, ids[0], outbox.Expect{}) })
			}
			wg.Wait()
			ok := 0
			for _, err := range errs {
				if err == nil {
					ok++
				} else {
					require.ErrorIs(t, err, outbox.ErrNotQuarantined)
				}
			}
			require.Equal(t, 1, ok, "round %d: %v", i, errs)
		}
	})
}

// RequeueMatching by topic, then the failing rows, then the rest; and in
// several batches: the relay publishes exactly the requeued rows, each once.
func TestRequeueMatching(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		db := b.schema()
		b.seed(t,
			seedRow{Topic: "a", UUID: "a1", State: outbox.StateQuarantined, LastError: "refused"},
			seedRow{Topic: "b", UUID: "b1", State: outbox.StateQuarantined, LastError: "refused"},
			seedRow{Topic: "a", UUID: "a2", State: outbox.StateQuarantined, LastError: "refused"},
			seedRow{Topic: "a", UUID: "af", State: outbox.StateFailing, LastError: "broker down"},
			seedRow{Topic: "b", UUID: "b2", State: outbox.StateQuarantined, LastError: "refused"},
			seedRow{Topic: "a", UUID: "a3", State: outbox.StateQuarantined, LastError: "refused"},
		)
		rec := &recorder{}
		var relay *outbox.Relay
		if b.relays() {
			var err error
			relay, err = outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: rec, Logger: testenv.Logger(t), BatchSize: 500})
			require.NoError(t, err)
		}
		var taken []string // without a relay: the due rows taken
		relayed := func() {
			t.Helper()
			if relay == nil {
				taken = append(taken, b.takeDue(t)...)
				return
			}
			for {
				n, err := relay.Flush(b.ctx)
				require.NoError(t, err)
				if n == 0 {
					return
				}
			}
		}
		uuids := func(from int) []string {
			var out []string
			if relay == nil {
				return append(out, taken[from:]...)
			}
			for _, d := range rec.delivered()[from:] {
				out = append(out, d.Topic+"/"+d.UUID)
			}
			return out
		}
		relayed()
		require.Empty(t, uuids(0), "quarantined rows and a failing row not due: nothing to relay")

		n, err := mustStore(t, db).RequeueMatching(b.ctx, outbox.RowFilter{Topic: "a"})
		require.NoError(t, err)
		require.Equal(t, int64(3), n)
		relayed()
		require.Equal(t, []string{"a/a1", "a/a2", "a/a3"}, uuids(0))

		n, err = mustStore(t, db).RequeueMatching(b.ctx, outbox.RowFilter{State: outbox.StateFailing, Topic: "a"})
		require.NoError(t, err)
		require.Equal(t, int64(1), n, "the failing row is due now")
		relayed()
		require.Equal(t, []string{"a/af"}, uuids(3))

		n, err = mustStore(t, db).RequeueMatching(b.ctx, outbox.RowFilter{})
		require.NoError(t, err)
		require.Equal(t, int64(2), n)
		relayed()
		require.Equal(t, []string{"b/b1", "b/b2"}, uuids(4))
		n, err = mustStore(t, db).RequeueMatching(b.ctx, outbox.RowFilter{})
		require.NoError(t, err)
		require.Zero(t, n)

		// More rows than a batch, between rows of another tag.
		total := 2*outbox.MatchingBatch + 37
		b.seedBulk(t, "bulk", "other", 10)
		b.seedBulk(t, "bulk", "yes", total)
		b.seedBulk(t, "bulk", "other", 10)
		f := outbox.RowFilter{Metadata: map[string]string{"bulk": "yes"}}
		count, err := mustStore(t, db).Count(b.ctx, f)
		require.NoError(t, err)
		require.Equal(t, int64(total), count)
		n, err = mustStore(t, db).RequeueMatching(b.ctx, f)
		require.NoError(t, err)
		require.Equal(t, int64(total), n)
		count, err = mustStore(t, db).Count(b.ctx, f)
		require.NoError(t, err)
		require.Zero(t, count)
		relayed()
		got := map[string]int{}
		for _, u := range uuids(6) {
			got[u]++
		}
		require.Len(t, got, total)
		for u, c := range got {
			require.True(t, strings.HasPrefix(u, "bulk/yes-"), u)
			require.Equal(t, 1, c, u)
		}
		count, err = mustStore(t, db).Count(b.ctx, outbox.RowFilter{Metadata: map[string]string{"bulk": "other"}})
		require.NoError(t, err)
		require.Equal(t, int64(20), count, "the other rows stay quarantined")
	})
}

// Discard one and by filter: the rows are deleted and never published;
// rows not quarantined are refused by id and never selected by a filter.
func TestDiscard(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		db := b.schema()
		ids := b.seed(t,
			seedRow{Topic: "a", UUID: "q1", State: outbox.StateQuarantined, LastError: "message too large"},
			seedRow{Topic: "a", UUID: "q2", State: outbox.StateQuarantined, LastError: "bad header"},
			seedRow{Topic: "b", UUID: "q3", State: outbox.StateQuarantined, LastError: "Message Too Large"},
			seedRow{Topic: "a", UUID: "f1", State: outbox.StateFailing, LastError: "message too large"},
			seedRow{Topic: "a", UUID: "h1"},
		)
		q1, f1, h1 := ids[0], ids[3], ids[4]

		require.NoError(t, mustStore(t, db).Discard(b.ctx, q1, outbox.Expect{}))
		_, err := mustStore(t, db).Get(b.ctx, q1)
		require.ErrorIs(t, err, outbox.ErrRowNotFound)
		require.ErrorIs(t, mustStore(t, db).Discard(b.ctx, q1, outbox.Expect{}), outbox.ErrRowNotFound)
		require.ErrorIs(t, mustStore(t, db).Requeue(b.ctx, q1, outbox.Expect{}), outbox.ErrRowNotFound)
		require.ErrorIs(t, mustStore(t, db).Discard(b.ctx, f1, outbox.Expect{}), outbox.ErrNotQuarantined)
		require.ErrorIs(t, mustStore(t, db).Discard(b.ctx, h1, outbox.Expect{}), outbox.ErrNotQuarantined)

		_, err = mustStore(t, db).DiscardMatching(b.ctx, outbox.RowFilter{State: outbox.StateAll, Reason: "too large"})
		require.Error(t, err)
		n, err := mustStore(t, db).DiscardMatching(b.ctx, outbox.RowFilter{Reason: "TOO LARGE"})
		require.NoError(t, err)
		require.Equal(t, int64(1), n, "q3 (q1 is gone, f1 is failing)")
		page, err := mustStore(t, db).Find(b.ctx, outbox.RowFilter{State: outbox.StateAll}, outbox.Page{})
		require.NoError(t, err)
		require.Equal(t, []int64{ids[1], f1}, rowIDs(page.Rows))

		// The relay publishes what is left and due: the healthy row only.
		if b.relays() {
			rec := &recorder{}
			relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: rec, Logger: testenv.Logger(t)})
			require.NoError(t, err)
			_, err = relay.Flush(b.ctx)
			require.NoError(t, err)
			got := rec.delivered()
			require.Len(t, got, 1)
			require.Equal(t, "a/h1", got[0].Topic+"/"+got[0].UUID)
		} else {
			require.Equal(t, []string{"a/h1"}, b.takeDue(t))
		}

		// Everything quarantined before now, in several batches.
		total := 2*outbox.MatchingBatch + 3
		b.seedBulk(t, "bulk", "yes", total)
		n, err = mustStore(t, db).DiscardMatching(b.ctx, outbox.RowFilter{QuarantinedBefore: time.Now().Add(time.Minute)})
		require.NoError(t, err)
		require.Equal(t, int64(total+1), n, "the bulk rows and q2")
		page, err = mustStore(t, db).Find(b.ctx, outbox.RowFilter{State: outbox.StateAll}, outbox.Page{})
		require.NoError(t, err)
		require.Equal(t, []int64{f1}, rowIDs(page.Rows), "the failing row stays")
	})
}

// CountRowsAsOf counts at the database's time and returns the bounds of
// what it counted (AsOf, MaxID); an action given them acts on no row the
// count could not see: none quarantined (or quarantined again) after AsOf,
// none written after MaxID, failing rows included.
func TestCountRowsAsOf(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		db := b.schema()
		ids := b.seed(t,
			seedRow{Topic: "big", UUID: "q1", State: outbox.StateQuarantined, QuarantinedAt: time.Now().Add(-time.Minute)},
			seedRow{Topic: "big", UUID: "q2", State: outbox.StateQuarantined, QuarantinedAt: time.Now().Add(-time.Minute)},
			seedRow{Topic: "big", UUID: "f1", State: outbox.StateFailing},
			seedRow{Topic: "big", UUID: "h1"},
		)
		q1, q2, f1, h1 := ids[0], ids[1], ids[2], ids[3]
		c, err := mustStore(t, db).CountAsOf(b.ctx, outbox.RowFilter{Topic: "big", State: outbox.StateAll})
		require.NoError(t, err)
		require.Equal(t, int64(3), c.Count)
		require.Equal(t, f1, c.MaxID, "the largest id counted (h1 is not)")
		require.WithinDuration(t, time.Now(), c.AsOf, time.Minute, "the database's time")

		// Meanwhile: q1 requeued and quarantined again, a row quarantined
		// after the count, one whose quarantine committed late (its time
		// before AsOf, its id after MaxID), the healthy row failing.
		b.exec(t, `UPDATE `+b.tables.Outbox()+b.sql(` SET quarantined_at = $1 WHERE id = $2`, ` SET quarantined_at = ? WHERE id = ?`), c.AsOf.Add(time.Second), q1)
		late := b.seed(t,
			seedRow{Topic: "big", UUID: "q3", State: outbox.StateQuarantined, QuarantinedAt: c.AsOf.Add(time.Second)},
			seedRow{Topic: "big", UUID: "q4", State: outbox.StateQuarantined, QuarantinedAt: c.AsOf.Add(-time.Second)},
			seedRow{Topic: "big", UUID: "f2", State: outbox.StateFailing},
		)
		bound := outbox.RowFilter{Topic: "big", State: outbox.StateAll, AsOf: c.AsOf, MaxID: c.MaxID}
		again, err := mustStore(t, db).CountAsOf(b.ctx, bound)
		require.NoError(t, err)
		require.Equal(t, int64(2), again.Count, "q2 and f1: the set only shrank")
		require.Equal(t, f1, again.MaxID)
		require.True(t, again.AsOf.Equal(c.AsOf), "a count given AsOf counts as of it")
		page, err := mustStore(t, db).Find(b.ctx, bound, outbox.Page{})
		require.NoError(t, err)
		require.Equal(t, []int64{q2, f1}, rowIDs(page.Rows))
		n, err := mustStore(t, db).Count(b.ctx, outbox.RowFilter{Topic: "big", AsOf: c.AsOf})
		require.NoError(t, err)
		require.Equal(t, int64(2), n, "AsOf alone: q2 and q4 (quarantined before it)")

		n, err = mustStore(t, db).RequeueMatching(b.ctx, outbox.RowFilter{State: outbox.StateFailing, AsOf: c.AsOf, MaxID: c.MaxID})
		require.NoError(t, err)
		require.Equal(t, int64(1), n, "f1; not f2, written after the count")
		n, err = mustStore(t, db).DiscardMatching(b.ctx, outbox.RowFilter{AsOf: c.AsOf, MaxID: c.MaxID})
		require.NoError(t, err)
		require.Equal(t, int64(1), n, "AsOf is a criterion: every row quarantined by then, of those counted: q2")
		page, err = mustStore(t, db).Find(b.ctx, outbox.RowFilter{State: outbox.StateAll}, outbox.Page{})
		require.NoError(t, err)
		require.Equal(t, []int64{q1, late[0], late[1], late[2]}, rowIDs(page.Rows))
		_, err = mustStore(t, db).Get(b.ctx, h1)
		require.NoError(t, err)

		// Nothing counted: MaxID 0, and nothing is bounded by it.
		c, err = mustStore(t, db).CountAsOf(b.ctx, outbox.RowFilter{Topic: "none"})
		require.NoError(t, err)
		require.Equal(t, int64(0), c.Count)
		require.Equal(t, int64(0), c.MaxID)

		_, err = mustStore(t, db).CountAsOf(b.ctx, outbox.RowFilter{MaxID: -1})
		require.ErrorContains(t, err, "outbox: CountAsOf: RowFilter.MaxID is -1")
	})
}
