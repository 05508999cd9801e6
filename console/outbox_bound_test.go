package console

import (
	"net/http"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// A bulk action on outbox rows acts only on rows its count saw: the count
// answers the database's time (as_of) and the largest id it counted
// (max_id), the action carries them and selects no row quarantined after
// as_of or written after max_id. A set that changed under the same count
// (one row gone, another quarantined since) is refused, nothing done.
func TestOutboxBulkActsOnCountedRowsOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	big := func() []int64 {
		t.Helper()
		var ids []int64
		rows, err := testenv.OutboxStore(t, e.db).Find(e.ctx, outbox.RowFilter{State: outbox.StateAll, Topic: "big"}, outbox.Page{})
		require.NoError(t, err)
		for _, r := range rows.Rows {
			ids = append(ids, r.ID)
		}
		return ids
	}
	q := []int64{e.row("big", "b1", "{}", nil, "quarantined"), e.row("big", "b2", "{}", nil, "quarantined"), e.row("big", "b3", "{}", nil, "quarantined")}

	c := ok(t, e.get("/eo/api/v1/outbox/rows/count?topic=big"))
	require.EqualValues(t, 3, c["count"])
	require.NotEmpty(t, c["as_of"], "the count says when it counted: %v", c)
	require.EqualValues(t, q[2], c["max_id"], "and the largest id it counted")

	// Meanwhile one counted row is discarded and another one quarantined:
	// still 3 match the filter, not the 3 the operator saw.
	require.NoError(t, testenv.OutboxStore(t, e.db).Discard(e.ctx, q[0], outbox.Expect{}))
	late := e.row("big", "late", "{}", nil, "")
	_, err := e.db.Conn.ExecContext(e.ctx, `UPDATE `+e.db.Outbox()+` SET failures = 5, attempts = 5, last_error = 'x', quarantined_at = now() WHERE id = $1`, late)
	require.NoError(t, err)

	// Without the count's bounds: refused (it would act on whatever
	// matches at the time of the action).
	w := e.call("POST", "/eo/api/v1/outbox/rows/discard", map[string]any{"topic": "big", "expect": 3})
	apiErr(t, w, http.StatusBadRequest, codeBadFilter)
	require.Equal(t, []int64{q[1], q[2], late}, big(), "nothing discarded")

	// With them: 2 of the 3 counted rows still match; refused, nothing done,
	// with the count now and its bounds.
	w = e.call("POST", "/eo/api/v1/outbox/rows/discard", map[string]any{"topic": "big", "expect": 3, "as_of": c["as_of"], "max_id": c["max_id"]})
	changed := apiErr(t, w, http.StatusConflict, codeCountChanged)
	require.EqualValues(t, 3, *changed.Count, "3 match now")
	require.Contains(t, changed.Message, "2 of the 3")
	require.NotNil(t, changed.AsOf)
	require.EqualValues(t, late, *changed.MaxID)
	require.Equal(t, []int64{q[1], q[2], late}, big(), "nothing discarded")

	// Confirming the new count (and its bounds) acts on those rows only.
	e.row("big", "later", "{}", nil, "quarantined")
	w = e.call("POST", "/eo/api/v1/outbox/rows/discard", map[string]any{"topic": "big", "expect": 3, "as_of": changed.AsOf, "max_id": *changed.MaxID})
	require.EqualValues(t, 3, ok(t, w)["discarded"])
	require.Len(t, big(), 1, "the row quarantined after the count stays")

	// Bad bounds.
	for _, body := range []map[string]any{
		{"topic": "big", "expect": 1, "max_id": 9},                                               // no as_of
		{"topic": "big", "expect": 1, "as_of": "2h", "max_id": 9},                                // relative
		{"topic": "big", "expect": 1, "as_of": time.Now().Add(time.Hour), "max_id": 9},           // the future
		{"topic": "big", "expect": 1, "as_of": c["as_of"]},                                       // no max_id
		{"topic": "big", "expect": 1, "as_of": c["as_of"], "max_id": -1},                         // negative
		{"topic": "big", "expect": 1, "as_of": c["as_of"], "max_id": 9, "before": "2h"},          // a relative time
		{"topic": "big", "expect": 1, "as_of": c["as_of"], "max_id": 9, "since": "not a time"},   // not a time
		{"topic": "big", "expect": 1, "as_of": "2025-01-01T00:00:00", "max_id": 9, "state": "x"}, // a bad state
	} {
		apiErr(t, e.call("POST", "/eo/api/v1/outbox/rows/discard", body), http.StatusBadRequest, codeBadFilter)
	}
	require.Len(t, big(), 1)
}

// Failing rows hold no time of their failure: a bulk requeue of failing
// rows is bounded by the largest id the count saw (max_id), so a row
// written after the count is not requeued.
func TestOutboxBulkRequeueFailingBoundedByID(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	f1, f2 := e.row("t", "f1", "{}", nil, "failing"), e.row("t", "f2", "{}", nil, "failing")
	c := ok(t, e.get("/eo/api/v1/outbox/rows/count?state=failing"))
	require.EqualValues(t, 2, c["count"])
	require.EqualValues(t, f2, c["max_id"])

	_, err := e.db.Conn.ExecContext(e.ctx, `DELETE FROM `+e.db.Outbox()+` WHERE id = $1`, f1)
	require.NoError(t, err)
	f3 := e.row("t", "f3", "{}", nil, "failing")
	w := e.call("POST", "/eo/api/v1/outbox/rows/requeue", map[string]any{"state": "failing", "all": true, "expect": 2, "as_of": c["as_of"], "max_id": c["max_id"]})
	changed := apiErr(t, w, http.StatusConflict, codeCountChanged)
	require.EqualValues(t, 2, *changed.Count)
	require.EqualValues(t, 2, testenv.Count(t, e.db.Conn, `SELECT count(*) FROM `+e.db.Outbox()+` WHERE failures > 0`), "nothing requeued")

	// Once more with one row only: the later row is not touched.
	c = ok(t, e.get("/eo/api/v1/outbox/rows/count?state=failing&uuid=f2"))
	require.EqualValues(t, 1, c["count"])
	w = e.call("POST", "/eo/api/v1/outbox/rows/requeue", map[string]any{"state": "failing", "all": true, "expect": 1, "as_of": c["as_of"], "max_id": f3 - 1})
	require.EqualValues(t, 1, ok(t, w)["requeued"])
	require.EqualValues(t, 1, testenv.Count(t, e.db.Conn, `SELECT count(*) FROM `+e.db.Outbox()+` WHERE failures > 0 AND id = $1`, f3), "f3 is still failing")
}

// The confirmation page carries the count's bounds: confirming after the
// set changed under the same count is refused, nothing done.
func TestOutboxBulkPageCarriesBounds(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	q1 := e.row("big", "b1", "{}", nil, "quarantined")
	e.row("big", "b2", "{}", nil, "quarantined")
	body := page(t, e.call("POST", "/eo/outbox/discard", url.Values{"topic": {"big"}}), http.StatusOK)
	require.Equal(t, "This discards 2 rows.", text(t, body, "confirm-count"))
	action, v := form(t, body, "confirm-form")

	require.NoError(t, testenv.OutboxStore(t, e.db).Discard(e.ctx, q1, outbox.Expect{}))
	e.row("big", "late", "{}", nil, "quarantined")
	_, err := e.db.Conn.ExecContext(e.ctx, `UPDATE `+e.db.Outbox()+` SET quarantined_at = now() WHERE uuid = 'late'`)
	require.NoError(t, err)

	body = page(t, e.call("POST", action, v), http.StatusConflict)
	require.Contains(t, text(t, body, "count-changed"), "Nothing was done")
	require.EqualValues(t, 1, e.outboxRows("big", "late"), "the row quarantined after the count is not discarded")
	require.Equal(t, "This discards 2 rows.", text(t, body, "confirm-count"))
	action, v = form(t, body, "confirm-form")
	body = page(t, e.call("POST", action, v), http.StatusOK)
	require.Equal(t, "Done: Discarded 2 rows.", text(t, body, "result"))
}

// Rows quarantined while a bulk discard runs are not discarded: the
// action selects the rows its count saw (a review found 20,191 discarded
// for 20,000 confirmed).
func TestOutboxBulkDiscardWhileQuarantining(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	_, err := e.db.Conn.ExecContext(e.ctx, `INSERT INTO `+e.db.Outbox()+` (topic, uuid, payload, metadata, failures, attempts, last_error, quarantined_at)
SELECT 'big', 'u' || g, '\x00'::bytea, '{}'::jsonb, 5, 5, 'x', now() - interval '1 minute' FROM generate_series(1, 2000) g`)
	require.NoError(t, err)
	c := ok(t, e.get("/eo/api/v1/outbox/rows/count?topic=big"))
	require.EqualValues(t, 2000, c["count"])

	stop := make(chan struct{})
	var late atomic.Int64
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			if _, err := e.db.Conn.ExecContext(e.ctx, `INSERT INTO `+e.db.Outbox()+` (topic, uuid, payload, metadata, failures, attempts, last_error, quarantined_at)
VALUES ('big', 'late-' || gen_random_uuid(), '\x00'::bytea, '{}'::jsonb, 5, 5, 'x', now())`); err == nil {
				late.Add(1)
			}
		}
	}()
	time.Sleep(10 * time.Millisecond)
	w := e.call("POST", "/eo/api/v1/outbox/rows/discard", map[string]any{"topic": "big", "expect": 2000, "as_of": c["as_of"], "max_id": c["max_id"]})
	close(stop)
	wg.Wait()
	m := ok(t, w)
	require.EqualValues(t, 2000, m["discarded"])
	require.EqualValues(t, 2000, m["matched"])
	require.Positive(t, late.Load())
	require.Equal(t, late.Load(), testenv.Count(t, e.db.Conn, `SELECT count(*) FROM `+e.db.Outbox()+` WHERE uuid LIKE 'late-%'`), "every late row is still there")
}
