package console_test

import (
	"bytes"
	"context"
	_ "embed"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/console"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// BenchmarkConsole measures the admin API's and the pages' response times,
// through the real handler over HTTP (an httptest server, a bearer token),
// on an inbox of 10,000,000 records over 20 consumers of which 1,000,000
// are parked with their messages, and an outbox of 100,000 rows of which
// 2,000 quarantined (testdata/bench_console.sql describes the data set).
// Each sub-benchmark sends its requests one after another and reports
// their latency's p50, p95 and max (nearest rank, to the end of the
// body), the share of answers that were the console's refusal of a search
// for its cost (refused: 422 too_broad, Config.MaxScan and MaxCount; a
// console without those bounds answers them), and the 1-minute load
// average when it started (load1):
//
//	BENCH_CONSOLE=1 go test -run '^$' -bench Console -benchtime 200x -timeout 2h ./console/
//
// The data set is generated once, set-based (about 4 minutes on the
// development machine), in schema eo_bench_console, and reused while its
// marker and counts match; BENCH_CONSOLE_REBUILD=1 generates it again.
// BENCH_CONSOLE_INBOX_ROWS, BENCH_CONSOLE_PARKED and
// BENCH_CONSOLE_OUTBOX_ROWS set other sizes (a quick run: 200000 and
// 20000), kept in a schema named after them, so that a quick run never
// replaces the full data set. Without
// BENCH_CONSOLE=1 it skips: go test and make test never build the data
// set. Where a console answers the searches by text without a bound, some
// take seconds a request (search_reason_recent, count_reason,
// search_tenant_missing; count_all about 0.3 s): run those with fewer
// requests, the others with 200 (docs/console.md, Cost and limits):
//
//	-bench '^BenchmarkConsole$/^(search_reason|search_reason_recent|count_reason|search_tenant_missing|count_all)$' -benchtime 20x
//
// Sub-benchmarks:
//   - overview_warm: GET /api/v1/overview once its figures are computed
//     (the cache is warm; StatsInterval is an hour, so no refresh runs
//     during the measurement). cold-first-ms is the first request to a new
//     handler (it waits at most a second for the figures, then answers
//     without them); figures-s is how long the first figures took (the
//     background computation: Stats and CountParked of every consumer,
//     and the outbox's backlog).
//   - search_meta_found, search_meta_missing: GET /api/v1/parked?meta=
//     order_id:<id>, a business id that exists (200 different ones, each
//     parked once or twice), and one that does not.
//   - count_meta: GET /api/v1/parked/count?meta=order_id:<id>, the count a
//     bulk replay or discard by business id is confirmed with.
//   - show: GET /api/v1/parked/{consumer}/{key}, one message with its
//     payload (the 200 messages of search_meta_found).
//   - search_consumer_largest, search_consumer_incident: the first page
//     (50) of GET /api/v1/parked?consumer=, for the consumer with the most
//     parked messages (spread over the 30 days), and for one whose 40,000
//     parked messages are all from the last 2 days (an incident).
//   - search_reason, search_reason_recent: the first page of GET
//     /api/v1/parked?reason=<text>, a text of 2-3% of the parked messages
//     spread over the 30 days, and the incident's text (only in the last
//     2 days). The reason has no index: a console with Config.MaxScan
//     refuses both (the reason alone would be checked on every message).
//   - search_reason_narrow, count_reason_narrow: the incident's text with
//     its consumer and the last 6 hours (about 5,000 messages to check:
//     within MaxScan), the page and the count.
//   - search_tenant_missing: GET /api/v1/parked?tenant=nobody, a tenant
//     without the consumer (no index: refused with MaxScan);
//     search_tenant_consumer: a tenant of a consumer that scopes its keys
//     by tenant (the consumer's index holds the key).
//   - count_reason: the count of search_reason (refused with MaxScan);
//     count_all: GET /api/v1/parked/count, 1,000,000 (refused with
//     MaxCount); count_consumer_incident: the incident consumer's 40,000.
//   - page_1000, page_1000_html: pages of 1,000 parked messages of the API
//     and of the web console, each after the previous one (cold: the
//     records' status of each page is read for the first time);
//     page_parked_html: the web console's parked page as it opens (50
//     messages and their count).
//   - outbox_rows_1000, outbox_page_1000_html: pages of 1,000 quarantined
//     rows (the API's, each after the previous; the web console's first);
//     outbox_count: their count; outbox_search_reason: the first page by
//     the error's text; outbox_show: one row with its payload.
//   - overview_warm_during_refresh, search_meta_found_during_refresh: as
//     overview_warm and search_meta_found while the overview's
//     computation runs (the same store calls, in a loop of this
//     benchmark's, as a refresh every StatsInterval runs them; refresh-s is
//     the mean duration of one pass), one request every 50 ms (not
//     timed: ns/op excludes the gaps).
func BenchmarkConsole(b *testing.B) {
	if os.Getenv("BENCH_CONSOLE") != "1" {
		b.Skip("BenchmarkConsole needs a data set of 10M inbox records and 1M parked messages, generated once (minutes) in schema " +
			benchSchema + ": BENCH_CONSOLE=1 go test -run '^$' -bench Console -benchtime 200x -timeout 2h ./console/ " +
			"(BENCH_CONSOLE_INBOX_ROWS=200000 BENCH_CONSOLE_PARKED=20000 for a quick run; BENCH_CONSOLE_REBUILD=1 generates it again)")
	}
	sizes, err := benchSizesFromEnv()
	require.NoError(b, err)
	ctx := context.Background()
	pool := testenv.Pool(b)
	db, info, err := benchDataset(ctx, pool, sizes, os.Getenv("BENCH_CONSOLE_REBUILD") == "1", b.Logf)
	require.NoError(b, err)
	how := "generated now"
	if info.Reused {
		how = "reused, generated " + info.GeneratedAt.UTC().Format(time.RFC3339)
	}
	dataset := fmt.Sprintf("data set %s (%s in %s): %d inbox records, %d parked, %d outbox rows; on disk (pg_total_relation_size): inbox %s, parked %s, outbox %s",
		db.Schema, how, info.Took.Round(time.Second), sizes.inboxRows, sizes.parked, sizes.outboxRows,
		benchMiB(info.Bytes["inbox"]), benchMiB(info.Bytes["parked"]), benchMiB(info.Bytes["outbox"]))
	sample := benchSampleOf(ctx, b, pool, db)

	const token = "bench-console-token-0123456789abcdef"
	h, err := console.New(console.Config{DB: db, Auth: console.BearerToken(token), StatsInterval: time.Hour,
		Logger: slog.New(slog.DiscardHandler)})
	require.NoError(b, err)
	srv := httptest.NewServer(h)
	b.Cleanup(srv.Close)
	c := &benchClient{base: srv.URL + "/api/v1", token: token, http: srv.Client()}
	pc := &benchClient{base: srv.URL, token: token, http: srv.Client()} // the pages

	// The first overview: it starts the figures' computation and waits for
	// it at most a second; then the figures, polled until computed.
	start := time.Now()
	var ov struct {
		AsOf       *time.Time `json:"as_of"`
		Refreshing bool       `json:"refreshing"`
		Consumers  []struct {
			Consumer string `json:"consumer"`
			Total    *int64 `json:"total"`
		} `json:"consumers"`
		Outbox *struct {
			Pending int64 `json:"pending"`
		} `json:"outbox"`
		Errors []string `json:"errors"`
	}
	cold := c.getJSON(b, "/overview", &ov)
	coldFigures := ov.AsOf != nil
	for ov.AsOf == nil || ov.Refreshing {
		if time.Since(start) > 10*time.Minute {
			b.Fatalf("the overview's figures were not computed within 10 minutes")
		}
		time.Sleep(100 * time.Millisecond)
		c.getJSON(b, "/overview", &ov)
	}
	figures := time.Since(start)
	var total int64
	for _, f := range ov.Consumers {
		if f.Total != nil {
			total += *f.Total
		}
	}
	require.Empty(b, ov.Errors)
	require.Equal(b, sizes.inboxRows, total, "the overview's records")
	require.NotNil(b, ov.Outbox)
	coldNote := fmt.Sprintf("overview: the first request took %s (with figures: %v); the figures of %d consumers were computed in %s; outbox pending %d",
		cold.Round(time.Millisecond), coldFigures, len(ov.Consumers), figures.Round(time.Millisecond), ov.Outbox.Pending)

	warmOverview := func(body []byte) error {
		var d struct {
			AsOf       *time.Time `json:"as_of"`
			Refreshing bool       `json:"refreshing"`
			Consumers  []struct{} `json:"consumers"`
		}
		if err := json.Unmarshal(body, &d); err != nil {
			return err
		}
		if d.AsOf == nil || d.Refreshing || len(d.Consumers) != len(ov.Consumers) {
			return fmt.Errorf("not the warm figures: as_of %v, refreshing %v, %d consumers", d.AsOf, d.Refreshing, len(d.Consumers))
		}
		return nil
	}
	metaFound := func(i int) string {
		return "/parked?meta=" + url.QueryEscape("order_id:"+sample.orders[i%len(sample.orders)].orderID)
	}

	b.Run("overview_warm", func(b *testing.B) {
		b.Log(dataset)
		b.Log(coldNote)
		benchRequests(b, c, 0, func(int) string { return "/overview" }, ok200(warmOverview))
		b.ReportMetric(float64(cold)/1e6, "cold-first-ms")
		b.ReportMetric(figures.Seconds(), "figures-s")
	})
	b.Run("search_meta_found", func(b *testing.B) {
		benchRequests(b, c, 0, metaFound, ok200(wantMessages(1, 2)))
	})
	b.Run("search_meta_missing", func(b *testing.B) {
		benchRequests(b, c, 0, func(i int) string { return "/parked?meta=" + url.QueryEscape(fmt.Sprintf("order_id:ORD-X%07d", i)) }, ok200(wantMessages(0, 0)))
	})
	b.Run("count_meta", func(b *testing.B) {
		benchRequests(b, c, 0, func(i int) string {
			return "/parked/count?meta=" + url.QueryEscape("order_id:"+sample.orders[i%len(sample.orders)].orderID)
		}, ok200(wantCount(1, 2)))
	})
	b.Run("show", func(b *testing.B) {
		benchRequests(b, c, 0, func(i int) string {
			o := sample.orders[i%len(sample.orders)]
			return "/parked/" + url.PathEscape(o.consumer) + "/" + url.PathEscape(o.key)
		}, ok200(func(body []byte) error {
			var d struct {
				Key     string    `json:"key"`
				Payload *struct{} `json:"payload"`
			}
			if err := json.Unmarshal(body, &d); err != nil {
				return err
			}
			if d.Key == "" {
				return errors.New("no message")
			}
			return nil
		}))
	})
	b.Run("search_consumer_largest", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string { return "/parked?consumer=" + url.QueryEscape(sample.largest) }, ok200(wantMessages(50, 50)))
	})
	b.Run("search_consumer_incident", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string { return "/parked?consumer=" + url.QueryEscape(benchIncidentConsumer) }, ok200(wantMessages(50, 50)))
	})
	b.Run("search_reason", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string { return "/parked?reason=" + url.QueryEscape(benchRareReason) }, orTooBroad(wantMessages(50, 50)))
	})
	b.Run("search_reason_recent", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string { return "/parked?reason=" + url.QueryEscape(benchIncidentReason) }, orTooBroad(wantMessages(50, 50)))
	})
	b.Run("search_reason_narrow", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string {
			return "/parked?" + url.Values{"consumer": {benchIncidentConsumer}, "reason": {benchIncidentReason}, "since": {"6h"}}.Encode()
		}, ok200(wantMessages(50, 50)))
	})
	b.Run("search_tenant_missing", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string { return "/parked?tenant=nobody" }, orTooBroad(wantMessages(0, 0)))
	})
	b.Run("search_tenant_consumer", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string {
			return "/parked?" + url.Values{"consumer": {benchTenantConsumer}, "tenant": {"acme"}}.Encode()
		},
			ok200(wantMessages(50, 50)))
	})
	b.Run("count_reason", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string { return "/parked/count?reason=" + url.QueryEscape(benchRareReason) }, orTooBroad(wantCount(1, math.MaxInt64)))
	})
	b.Run("count_reason_narrow", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string {
			return "/parked/count?" + url.Values{"consumer": {benchIncidentConsumer}, "reason": {benchIncidentReason}, "since": {"6h"}}.Encode()
		}, ok200(wantCount(1, math.MaxInt64)))
	})
	b.Run("count_all", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string { return "/parked/count" }, orTooBroad(wantCount(sizes.parked, sizes.parked)))
	})
	b.Run("count_consumer_incident", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string { return "/parked/count?consumer=" + url.QueryEscape(benchIncidentConsumer) },
			orTooBroad(wantCount(1, math.MaxInt64)))
	})
	// Pages of 1,000, each after the previous one (the next_after of the
	// answer): the records' status of each is looked up cold.
	var after string
	b.Run("page_1000", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string { return "/parked?limit=1000" + afterParam(after) }, ok200(func(body []byte) error {
			var d struct {
				Messages []struct{} `json:"messages"`
				Next     string     `json:"next_after"`
			}
			if err := json.Unmarshal(body, &d); err != nil {
				return err
			}
			if len(d.Messages) != 1000 {
				return fmt.Errorf("%d messages, want 1000", len(d.Messages))
			}
			after = d.Next
			return nil
		}))
	})
	b.Run("page_1000_html", func(b *testing.B) {
		benchRequests(b, pc, 0, func(int) string { return "/parked?limit=1000" + afterParam(after) }, ok200(func(body []byte) error {
			if n := bytes.Count(body, []byte(`<tr class="parked-row">`)); n != 1000 {
				return fmt.Errorf("%d rows, want 1000", n)
			}
			next := regexp.MustCompile(`after=([^&"]+)`).FindSubmatch(body)
			if next == nil {
				return errors.New("no next page")
			}
			a, err := url.QueryUnescape(string(next[1]))
			after = a
			return err
		}))
	})
	b.Run("page_parked_html", func(b *testing.B) {
		benchRequests(b, pc, 0, func(int) string { return "/parked" }, ok200(func(body []byte) error {
			if n := bytes.Count(body, []byte(`<tr class="parked-row">`)); n != 50 {
				return fmt.Errorf("%d rows, want 50", n)
			}
			return nil
		}))
	})

	// The outbox: 2% of its rows quarantined (2,000 of 100,000).
	var quarantined []int64
	b.Run("outbox_rows_1000", func(b *testing.B) {
		var rowsAfter int64
		benchRequests(b, c, 0, func(int) string { return fmt.Sprintf("/outbox/rows?limit=1000&after=%d", rowsAfter) }, ok200(func(body []byte) error {
			var d struct {
				Rows []struct {
					ID int64 `json:"id"`
				} `json:"rows"`
				Next int64 `json:"next_after"`
			}
			if err := json.Unmarshal(body, &d); err != nil {
				return err
			}
			if len(d.Rows) == 0 {
				return errors.New("no rows")
			}
			for _, r := range d.Rows {
				quarantined = append(quarantined, r.ID)
			}
			rowsAfter = d.Next // 0 after the last page: the first again
			return nil
		}))
	})
	b.Run("outbox_page_1000_html", func(b *testing.B) {
		benchRequests(b, pc, 0, func(int) string { return "/outbox?limit=1000" }, ok200(func(body []byte) error {
			if n := bytes.Count(body, []byte(`<tr class="outbox-row">`)); n != 1000 {
				return fmt.Errorf("%d rows, want 1000", n)
			}
			return nil
		}))
	})
	b.Run("outbox_count", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string { return "/outbox/rows/count" }, ok200(wantCount(1, math.MaxInt64)))
	})
	b.Run("outbox_search_reason", func(b *testing.B) {
		benchRequests(b, c, 0, func(int) string { return "/outbox/rows?reason=precondition" }, orTooBroad(func(body []byte) error {
			var d struct {
				Rows []struct{} `json:"rows"`
			}
			if err := json.Unmarshal(body, &d); err != nil {
				return err
			}
			if len(d.Rows) != 50 {
				return fmt.Errorf("%d rows, want 50", len(d.Rows))
			}
			return nil
		}))
	})
	b.Run("outbox_show", func(b *testing.B) {
		require.NotEmpty(b, quarantined, "outbox_rows_1000 runs first")
		benchRequests(b, c, 0, func(i int) string { return fmt.Sprintf("/outbox/rows/%d", quarantined[i%len(quarantined)]) }, ok200(func(body []byte) error {
			var d struct {
				ID int64 `json:"id"`
			}
			if err := json.Unmarshal(body, &d); err != nil {
				return err
			}
			if d.ID == 0 {
				return errors.New("no row")
			}
			return nil
		}))
	})

	store, err := inbox.NewStore(db)
	require.NoError(b, err)
	b.Run("overview_warm_during_refresh", func(b *testing.B) {
		defer benchRefreshing(b, store, db)()
		benchRequests(b, c, benchRefreshGap, func(int) string { return "/overview" }, ok200(warmOverview))
	})
	b.Run("search_meta_found_during_refresh", func(b *testing.B) {
		defer benchRefreshing(b, store, db)()
		benchRequests(b, c, benchRefreshGap, metaFound, ok200(wantMessages(1, 2)))
	})
}

// benchRefreshGap spaces the requests of the *_during_refresh lines, so
// that 200 of them spread over most of a pass of the computation (about
// 10 s on the full data set) instead of its first fraction of a second.
const benchRefreshGap = 50 * time.Millisecond

// benchRefreshing runs the overview's computation (the store calls of
// console's statsCache: the consumers, then Stats and CountParked of
// each, then the outbox's backlog) in a loop until the function it
// returns is called; that function lets the pass under way end, then
// reports the mean duration of the passes (refresh-s).
func benchRefreshing(b *testing.B, store *inbox.Store, db sqlschema.DB) func() {
	ctx := context.Background()
	rows := testenv.OutboxStore(b, db)
	var stop atomic.Bool
	done := make(chan struct{})
	var passes int
	var took time.Duration
	go func() {
		defer close(done)
		for !stop.Load() {
			start := time.Now()
			names, err := store.Consumers(ctx, 101)
			for _, c := range names {
				if err != nil {
					break
				}
				if _, err = store.Stats(ctx, c); err == nil {
					_, err = store.CountParked(ctx, inbox.ParkedFilter{Consumer: c})
				}
			}
			if err == nil {
				_, err = rows.Pending(ctx)
			}
			if err != nil {
				b.Errorf("the overview's computation: %v", err)
				return
			}
			passes++
			took += time.Since(start)
		}
	}()
	time.Sleep(200 * time.Millisecond) // under way: past the consumers' list
	return func() {
		stop.Store(true)
		<-done
		if passes > 0 {
			b.ReportMetric((took / time.Duration(passes)).Seconds(), "refresh-s")
		}
	}
}

// benchIncidentConsumer parks only in the data set's last 2 days, all
// with benchIncidentReason; benchRareReason is the text of 2-3% of the
// other parks, spread over the 30 days (testdata/bench_console.sql).
const (
	benchIncidentConsumer = "payments.refund-worker"
	benchIncidentReason   = "currency HUF"
	benchRareReason       = "deadlock detected"
	// benchTenantConsumer scopes its keys by tenant (7.25% of the parks
	// before the incident; acme's a tenth of those).
	benchTenantConsumer = "tenants.invoice-mailer"
)

// benchSample is what the requests look for, read from the data set
// before the clock starts.
type benchSample struct {
	// orders are 200 parked messages, a business id each, spread over the
	// table (a Bernoulli sample).
	orders []struct{ orderID, consumer, key string }
	// largest is the consumer with the most parked messages.
	largest string
}

func benchSampleOf(ctx context.Context, b *testing.B, pool *pgxpool.Pool, db sqlschema.DB) benchSample {
	var s benchSample
	parked := pgx.Identifier{db.Schema, db.InboxTable + "_parked"}.Sanitize()
	rows, err := pool.Query(ctx, `SELECT metadata->>'order_id', consumer, message_key FROM `+parked+` TABLESAMPLE BERNOULLI (0.05) REPEATABLE (42)
WHERE metadata ? 'order_id' LIMIT 200`)
	require.NoError(b, err)
	for rows.Next() {
		var o struct{ orderID, consumer, key string }
		require.NoError(b, rows.Scan(&o.orderID, &o.consumer, &o.key))
		s.orders = append(s.orders, o)
	}
	require.NoError(b, rows.Err())
	require.NotEmpty(b, s.orders)
	require.NoError(b, pool.QueryRow(ctx, `SELECT consumer FROM `+parked+` GROUP BY consumer ORDER BY count(*) DESC LIMIT 1`).Scan(&s.largest))
	return s
}

type benchClient struct {
	base, token string
	http        *http.Client
}

// get sends GET path and returns the latency (to the end of the body),
// the status and the body.
func (c *benchClient) get(b *testing.B, path string) (time.Duration, int, []byte) {
	req, err := http.NewRequest(http.MethodGet, c.base+path, nil)
	require.NoError(b, err)
	req.Header.Set("Authorization", "Bearer "+c.token)
	start := time.Now()
	resp, err := c.http.Do(req)
	require.NoError(b, err)
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	took := time.Since(start)
	require.NoError(b, err)
	return took, resp.StatusCode, body
}

func (c *benchClient) getJSON(b *testing.B, path string, v any) time.Duration {
	took, status, body := c.get(b, path)
	require.Equal(b, http.StatusOK, status, "GET %s: %s", path, body)
	require.NoError(b, json.Unmarshal(body, v))
	return took
}

// benchCheck checks an answer: its status, then its body.
type benchCheck func(status int, body []byte) (refused bool, err error)

// ok200 wants 200 and a body that ok accepts.
func ok200(ok func(body []byte) error) benchCheck {
	return func(status int, body []byte) (bool, error) {
		if status != http.StatusOK {
			return false, fmt.Errorf("status %d", status)
		}
		return false, ok(body)
	}
}

// orTooBroad is ok200, or the console's refusal of a search or count for
// its cost (422 too_broad): a version of the console that bounds its
// searches (Config.MaxScan, MaxCount) refuses, an earlier one answers.
func orTooBroad(ok func(body []byte) error) benchCheck {
	return func(status int, body []byte) (bool, error) {
		if status == http.StatusUnprocessableEntity {
			var d struct {
				Error struct {
					Code string `json:"code"`
				} `json:"error"`
			}
			if err := json.Unmarshal(body, &d); err != nil {
				return true, fmt.Errorf("status 422: %w", err)
			}
			if d.Error.Code != "too_broad" {
				return true, fmt.Errorf("status 422, code %q, not too_broad", d.Error.Code)
			}
			return true, nil
		}
		return ok200(ok)(status, body)
	}
}

// afterParam is "&after=<after>", or "" for the first page.
func afterParam(after string) string {
	if after == "" {
		return ""
	}
	return "&after=" + url.QueryEscape(after)
}

// benchRequests sends b.N requests, one after another, to the paths of
// path(i), checks each answer, and reports the latencies' p50, p95 and
// max in milliseconds, the share of answers that were refusals
// (orTooBroad: refused), and the load average when it started. With a
// gap, it waits that long (timer stopped) after each request.
func benchRequests(b *testing.B, c *benchClient, gap time.Duration, path func(i int) string, check benchCheck) {
	load := benchLoad()
	var lat []time.Duration
	var refusals int
	for i := 0; b.Loop(); i++ {
		p := path(i)
		took, status, body := c.get(b, p)
		lat = append(lat, took)
		refused, err := check(status, body)
		if err != nil {
			b.Fatalf("GET %s: %v: %.2000s", p, err, body)
		}
		if refused {
			refusals++
		}
		if gap > 0 {
			b.StopTimer()
			time.Sleep(gap)
			b.StartTimer()
		}
	}
	slices.Sort(lat)
	rank := func(q float64) time.Duration { return lat[max(0, int(math.Ceil(q*float64(len(lat))))-1)] }
	b.ReportMetric(float64(rank(0.50))/1e6, "p50-ms")
	b.ReportMetric(float64(rank(0.95))/1e6, "p95-ms")
	b.ReportMetric(float64(lat[len(lat)-1])/1e6, "max-ms")
	b.ReportMetric(float64(refusals)/float64(len(lat)), "refused")
	b.ReportMetric(load, "load1")
}

// wantMessages checks a page of parked messages holds min to max.
func wantMessages(lo, hi int) func([]byte) error {
	return func(body []byte) error {
		var d struct {
			Messages []struct{} `json:"messages"`
		}
		if err := json.Unmarshal(body, &d); err != nil {
			return err
		}
		if len(d.Messages) < lo || len(d.Messages) > hi {
			return fmt.Errorf("%d messages, want %d to %d", len(d.Messages), lo, hi)
		}
		return nil
	}
}

// wantCount checks a count is from lo to hi.
func wantCount(lo, hi int64) func([]byte) error {
	return func(body []byte) error {
		var d struct {
			Count *int64 `json:"count"`
		}
		if err := json.Unmarshal(body, &d); err != nil {
			return err
		}
		if d.Count == nil || *d.Count < lo || *d.Count > hi {
			return fmt.Errorf("count %v, want %d to %d", d.Count, lo, hi)
		}
		return nil
	}
}

// benchLoad is the 1-minute load average (-1 where /proc has none).
func benchLoad() float64 {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return -1
	}
	f, err := strconv.ParseFloat(strings.Fields(string(b))[0], 64)
	if err != nil {
		return -1
	}
	return f
}

func benchMiB(n int64) string { return fmt.Sprintf("%.0f MiB", float64(n)/(1<<20)) }

// benchDatasetSQL generates the data set; see its header.
//
//go:embed testdata/bench_console.sql
var benchDatasetSQL string

// benchDatasetVersion is recorded with a generated data set: change it with
// testdata/bench_console.sql, so that an older data set is rebuilt.
const benchDatasetVersion = 3

// The data set's default sizes (the issue's), and the schema they live in.
const (
	benchDefaultInboxRows  = 10_000_000
	benchDefaultParked     = 1_000_000
	benchDefaultOutboxRows = 100_000
	benchSchema            = "eo_bench_console"
	benchChunk             = 1_000_000
)

type benchSizes struct{ inboxRows, parked, outboxRows int64 }

// benchDefaultSizes are the sizes of the full data set.
var benchDefaultSizes = benchSizes{benchDefaultInboxRows, benchDefaultParked, benchDefaultOutboxRows}

// benchSizesFromEnv reads BENCH_CONSOLE_INBOX_ROWS, BENCH_CONSOLE_PARKED
// and BENCH_CONSOLE_OUTBOX_ROWS.
func benchSizesFromEnv() (benchSizes, error) {
	s := benchDefaultSizes
	for _, v := range []struct {
		name string
		n    *int64
	}{{"BENCH_CONSOLE_INBOX_ROWS", &s.inboxRows}, {"BENCH_CONSOLE_PARKED", &s.parked}, {"BENCH_CONSOLE_OUTBOX_ROWS", &s.outboxRows}} {
		if e := os.Getenv(v.name); e != "" {
			n, err := strconv.ParseInt(strings.ReplaceAll(e, "_", ""), 10, 64)
			if err != nil || n < 1 {
				return s, fmt.Errorf("%s=%q: a positive number of rows", v.name, e)
			}
			*v.n = n
		}
	}
	if s.parked > s.inboxRows {
		return s, fmt.Errorf("BENCH_CONSOLE_PARKED (%d) is larger than BENCH_CONSOLE_INBOX_ROWS (%d): parked messages are inbox records", s.parked, s.inboxRows)
	}
	return s, nil
}

// schema is where a data set of these sizes lives: the default sizes in
// eo_bench_console, others in a schema named after them, so that a quick
// run never replaces the full data set.
func (s benchSizes) schema() string {
	if s == benchDefaultSizes {
		return benchSchema
	}
	return fmt.Sprintf("%s_%d_%d_%d", benchSchema, s.inboxRows, s.parked, s.outboxRows)
}

// benchDatasetInfo is what the data set's marker table records.
type benchDatasetInfo struct {
	Reused      bool
	GeneratedAt time.Time
	Anchor      time.Time // the end of the data set's 30 days
	Took        time.Duration
	Bytes       map[string]int64 // pg_total_relation_size of inbox, parked, outbox
}

// benchDataset returns the data set of sizes: the existing one when its
// marker says it was generated by this version for these sizes and the
// tables hold the expected counts (and rebuild is false), else a new one
// (the schema dropped and migrated again, the steps of
// testdata/bench_console.sql run, then the marker written). Either way
// sqlschema.Migrate runs, so that a migration added since applies. Two runs
// at once wait for each other (an advisory lock).
//
// It works on a connection of its own (with jit off: compiling the
// generator's expressions would take longer than running them), closed
// before it returns; the DB returned reaches the tables through pool.
func benchDataset(ctx context.Context, pool *pgxpool.Pool, sizes benchSizes, rebuild bool, logf func(string, ...any)) (sqlschema.DB, benchDatasetInfo, error) {
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: sizes.schema()}.WithDefaults()
	q := func(names ...string) string { return pgx.Identifier(names).Sanitize() }
	marker := q(db.Schema, "bench_console_dataset")
	var info benchDatasetInfo

	conn, err := pgx.ConnectConfig(ctx, pool.Config().ConnConfig.Copy())
	if err != nil {
		return db, info, err
	}
	defer func() { _ = conn.Close(context.WithoutCancel(ctx)) }() // also ends the advisory lock
	if _, err := conn.Exec(ctx, `SET jit = off`); err != nil {
		return db, info, err
	}
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock(hashtext($1))`, db.Schema); err != nil {
		return db, info, err
	}

	sizesOf := func() (map[string]int64, error) {
		out := map[string]int64{}
		for name, table := range map[string]string{"inbox": db.Inbox(), "parked": q(db.Schema, db.InboxTable+"_parked"), "outbox": db.Outbox()} {
			var n int64
			if err := conn.QueryRow(ctx, `SELECT pg_total_relation_size($1::regclass)`, table).Scan(&n); err != nil {
				return nil, err
			}
			out[name] = n
		}
		return out, nil
	}

	if !rebuild {
		var version int
		var rows, parked, outboxRows int64
		var took float64
		err := conn.QueryRow(ctx, `SELECT version, inbox_rows, parked, outbox_rows, generated_at, anchor, extract(epoch FROM took)::float8 FROM `+marker).
			Scan(&version, &rows, &parked, &outboxRows, &info.GeneratedAt, &info.Anchor, &took)
		got := benchSizes{rows, parked, outboxRows}
		switch {
		case err != nil:
			logf("data set %s: not found, incomplete or of an older version (%v): generating it", db.Schema, err)
		case version != benchDatasetVersion || got != sizes:
			logf("data set %s: version %d with sizes %+v: generating version %d with %+v", db.Schema, version, got,
				benchDatasetVersion, sizes)
		default:
			var nInbox, nParkedRecords, nParked, nOutbox int64
			err := conn.QueryRow(ctx, `SELECT (SELECT count(*) FROM `+db.Inbox()+`),
  (SELECT count(*) FROM `+db.Inbox()+` WHERE status = 'parked' AND status <> 'done'),
  (SELECT count(*) FROM `+q(db.Schema, db.InboxTable+"_parked")+`),
  (SELECT count(*) FROM `+db.Outbox()+`)`).Scan(&nInbox, &nParkedRecords, &nParked, &nOutbox)
			if err != nil {
				return db, info, err
			}
			if nInbox == sizes.inboxRows && nParkedRecords == sizes.parked && nParked == sizes.parked && nOutbox == sizes.outboxRows {
				if err := sqlschema.Migrate(ctx, db); err != nil {
					return db, info, err
				}
				info.Reused, info.Took = true, time.Duration(took*float64(time.Second))
				info.Bytes, err = sizesOf()
				return db, info, err
			}
			logf("data set %s: %d records, %d parked records, %d parked messages, %d outbox rows (changed since generated): generating it again", db.Schema,
				nInbox, nParkedRecords, nParked, nOutbox)
		}
	}

	start := time.Now()
	if _, err := conn.Exec(ctx, `DROP SCHEMA IF EXISTS `+q(db.Schema)+` CASCADE`); err != nil {
		return db, info, err
	}
	if err := sqlschema.Migrate(ctx, db); err != nil {
		return db, info, err
	}
	if err := conn.QueryRow(ctx, `SELECT date_trunc('second', now())`).Scan(&info.Anchor); err != nil {
		return db, info, err
	}
	stride := sizes.inboxRows / sizes.parked
	render := strings.NewReplacer(
		"{{schema}}", q(db.Schema), "{{inbox}}", db.Inbox(), "{{parked}}", q(db.Schema, db.InboxTable+"_parked"), "{{outbox}}", db.Outbox(),
		"{{N}}", strconv.FormatInt(sizes.inboxRows, 10), "{{P}}", strconv.FormatInt(sizes.parked, 10), "{{O}}", strconv.FormatInt(sizes.outboxRows, 10),
		"{{stride}}", strconv.FormatInt(stride, 10), "{{anchor}}", info.Anchor.UTC().Format(time.RFC3339))
	steps := strings.Split(benchDatasetSQL, "\n-- step: ")
	for _, step := range steps[1:] { // steps[0] is the header
		title, body, _ := strings.Cut(step, "\n")
		body = render.Replace(body)
		var total int64
		switch {
		case strings.HasSuffix(title, "(chunked over N)"):
			total = sizes.inboxRows
		case strings.HasSuffix(title, "(chunked over P)"):
			total = sizes.parked
		}
		if total == 0 {
			t0 := time.Now()
			if _, err := conn.Exec(ctx, body); err != nil {
				return db, info, fmt.Errorf("data set step %q: %w", title, err)
			}
			logf("data set %s: %s: %s", db.Schema, title, time.Since(t0).Round(time.Millisecond))
			continue
		}
		for lo := int64(1); lo <= total; lo += benchChunk {
			hi := min(lo+benchChunk-1, total)
			t0 := time.Now()
			sql := strings.NewReplacer("{{lo}}", strconv.FormatInt(lo, 10), "{{hi}}", strconv.FormatInt(hi, 10)).Replace(body)
			if _, err := conn.Exec(ctx, sql); err != nil {
				return db, info, fmt.Errorf("data set step %q, rows %d-%d: %w", title, lo, hi, err)
			}
			logf("data set %s: %s: rows %d-%d of %d: %s", db.Schema, title, lo, hi, total, time.Since(t0).Round(time.Millisecond))
		}
	}
	info.Took = time.Since(start)
	if _, err := conn.Exec(ctx, `CREATE TABLE `+marker+` AS SELECT $1::int AS version, $2::bigint AS inbox_rows, $3::bigint AS parked,
  $6::bigint AS outbox_rows, now() AS generated_at, $4::timestamptz AS anchor, make_interval(secs => $5) AS took`,
		benchDatasetVersion, sizes.inboxRows, sizes.parked, info.Anchor, info.Took.Seconds(), sizes.outboxRows); err != nil {
		return db, info, err
	}
	info.GeneratedAt = time.Now()
	info.Bytes, err = sizesOf()
	return db, info, err
}
