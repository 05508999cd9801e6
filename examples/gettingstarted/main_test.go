package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"go/ast"
	"go/parser"
	"go/scanner"
	"go/token"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// requireServices skips the test when PostgreSQL or RabbitMQ is unreachable,
// and fails it instead when CI=true.
func requireServices(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var missing []string
	if conn, err := pgx.Connect(ctx, testenv.DatabaseURL()); err != nil {
		missing = append(missing, fmt.Sprintf("PostgreSQL at %s: %v", testenv.DatabaseURL(), err))
	} else {
		_ = conn.Close(ctx)
	}
	if conn, err := amqp091.DialConfig(testenv.AMQPURL(), amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)}); err != nil {
		missing = append(missing, fmt.Sprintf("RabbitMQ at %s: %v", testenv.AMQPURL(), err))
	} else {
		_ = conn.Close()
	}
	if len(missing) == 0 {
		return
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("services unreachable (`make services` starts them): %s", strings.Join(missing, "; "))
	}
	t.Skipf("services unreachable (run `make services`, or set DATABASE_URL / AMQP_URL): %s", strings.Join(missing, "; "))
}

// TestGettingStarted runs the program (its run function) on its own schema
// and queues: 30 orders published by a plain AMQP producer with message_id
// set, 10 of them twice, become exactly 20 payment rows and 20 events on the
// events queue; a message without message_id ends on the poison queue; its
// HTTP server serves the metrics (20 processed, 10 duplicates, 20 relayed,
// an empty outbox) and the console behind CONSOLE_TOKEN; and run returns
// nil once its context is cancelled, its server no longer listening.
func TestGettingStarted(t *testing.T) {
	requireServices(t)
	schema := testenv.Unique(t, "gs_")
	orders, events, poison := testenv.Unique(t, "gs_orders_"), testenv.Unique(t, "gs_events_"), testenv.Unique(t, "gs_poison_")
	t.Setenv("DATABASE_URL", testenv.DatabaseURL())
	t.Setenv("AMQP_URL", testenv.AMQPURL())
	t.Setenv("DB_SCHEMA", schema)
	t.Setenv("ORDERS_QUEUE", orders)
	t.Setenv("EVENTS_QUEUE", events)
	t.Setenv("POISON_QUEUE", poison)
	const token = "gettingstarted-test-token-0123456789"
	t.Setenv("CONSOLE_TOKEN", token)
	addr := freeAddr(t)
	t.Setenv("HTTP_ADDR", addr)

	pool, err := pgxpool.New(context.Background(), testenv.DatabaseURL())
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	conn, err := amqp091.Dial(testenv.AMQPURL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		_, err := pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{schema}.Sanitize()+` CASCADE`)
		require.NoError(t, err)
		ch, err := conn.Channel()
		require.NoError(t, err)
		for _, q := range []string{orders, events, poison} {
			_, err := ch.QueueDelete(q, false, false, false)
			require.NoError(t, err, "deleting queue %s", q)
		}
	})

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()

	ch, err := conn.Channel()
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	// The queues this test consumes from, declared as their consumers would (as rabbitmq.Subscriber
	// does, and with the properties rabbitmq.Publisher declares them with before their first message).
	for _, q := range []string{events, poison} {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		require.NoError(t, err, "declaring queue %s", q)
	}
	// Running: the subscriber's consumer is on the orders queue.
	waitFor(t, done, 60*time.Second, "the program's consumer", func() bool {
		probe, err := conn.Channel() // a passive declare of a missing queue closes its channel
		require.NoError(t, err)
		defer func() { _ = probe.Close() }()
		q, err := probe.QueueDeclarePassive(orders, true, false, false, false, nil)
		return err == nil && q.Consumers == 1
	})

	publish := func(p amqp091.Publishing) {
		t.Helper()
		p.DeliveryMode = amqp091.Persistent
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", orders, false, false, p)
		require.NoError(t, err)
		acked, err := dc.WaitContext(ctx)
		require.NoError(t, err)
		require.True(t, acked)
	}
	order := func(i int) []byte { return fmt.Appendf(nil, `{"order_id": "o-%02d", "amount_cents": %d}`, i, 100*i) }
	published := 0
	for i := range 20 {
		copies := 1
		if i%2 == 0 { // 10 orders published twice
			copies = 2
		}
		for range copies {
			publish(amqp091.Publishing{MessageId: fmt.Sprintf("m-%02d", i), ContentType: "application/json", Body: order(i)})
			published++
		}
	}
	require.Equal(t, 30, published)
	anonymous := []byte(`{"order_id": "o-anonymous", "amount_cents": 1}`)
	publish(amqp091.Publishing{Body: anonymous}) // no message_id: cannot be deduplicated

	eventCh, err := conn.Channel()
	require.NoError(t, err)
	deliveries, err := eventCh.Consume(events, "", true, false, false, false, nil)
	require.NoError(t, err)
	got := map[string]int{} // events per order_id
	received := 0
	take := func(d amqp091.Delivery) {
		var ev struct {
			OrderID string `json:"order_id"`
		}
		require.NoError(t, json.Unmarshal(d.Body, &ev), "%s", d.Body)
		got[ev.OrderID]++
		received++
	}
	rows := func() int {
		var n int
		require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "payments"}.Sanitize()).Scan(&n))
		return n
	}
	poisoned := func() int {
		q, err := ch.QueueDeclarePassive(poison, true, false, false, false, nil)
		require.NoError(t, err)
		return q.Messages
	}
	waitFor(t, done, 60*time.Second, "20 events, 20 payments and the poisoned message", func() bool {
		for more := true; more; {
			select {
			case d := <-deliveries:
				take(d)
			default:
				more = false
			}
		}
		return received >= 20 && rows() >= 20 && poisoned() >= 1
	})
	time.Sleep(500 * time.Millisecond) // a repeated event or payment would show by now
	for more := true; more; {
		select {
		case d := <-deliveries:
			take(d)
		default:
			more = false
		}
	}

	require.Equal(t, 20, rows(), "one payment per distinct order")
	require.Equal(t, 20, received, "one event per payment")
	for i := range 20 {
		require.Equal(t, 1, got[fmt.Sprintf("o-%02d", i)], "events for o-%02d", i)
	}
	require.Equal(t, 1, poisoned())
	d, ok, err := ch.Get(poison, true)
	require.NoError(t, err)
	require.True(t, ok)
	require.Equal(t, anonymous, d.Body)
	require.Contains(t, d.Headers[wmw.ReasonForPoisonedKey], "invalid message key")
	var anon int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+pgx.Identifier{schema, "payments"}.Sanitize()+
		` WHERE order_id = 'o-anonymous'`).Scan(&anon))
	require.Zero(t, anon, "the message without message_id was not processed")

	// The metrics: the middleware's events, the relay's counters, the outbox backlog.
	var series map[string]float64
	waitFor(t, done, 30*time.Second, "the relay's counter and the outbox gauge at 20 and 0", func() bool {
		series = scrapeMetrics(t, "http://"+addr+"/metrics")
		return series["exactlyonce_relay_relayed_total"] == 20 && series["exactlyonce_outbox_pending_rows"] == 0
	})
	require.Equal(t, float64(20), series[`exactlyonce_deliveries_total{consumer="payments",outcome="processed"}`], "%v", series)
	require.Equal(t, float64(10), series[`exactlyonce_deliveries_total{consumer="payments",outcome="duplicate"}`], "%v", series)
	require.Contains(t, series, `exactlyonce_batch_size_count{consumer="payments"}`, "group commit's batches")
	// The console, on the same server, behind the token.
	status, _ := httpGet(t, "http://"+addr+"/exactlyonce/api/v1/parked", "")
	require.Equal(t, http.StatusUnauthorized, status, "the console without the token")
	status, body := httpGet(t, "http://"+addr+"/exactlyonce/api/v1/parked", token)
	require.Equal(t, http.StatusOK, status, "the console with the token: %s", body)

	cancel()
	select {
	case err := <-done:
		require.NoError(t, err, "run after its context was cancelled")
	case <-time.After(30 * time.Second):
		t.Fatal("run did not return within 30s of its context being cancelled")
	}
	_, err = net.Dial("tcp", addr)
	require.Error(t, err, "the HTTP server stopped with run")
}

// freeAddr returns a loopback address no one listens on (just now).
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// httpGet sends GET url, with token as a bearer token unless empty, on a
// connection of its own; it returns the status and the body.
func httpGet(t *testing.T, url, token string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
	res, err := client.Do(req)
	require.NoError(t, err)
	defer func() { _ = res.Body.Close() }()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(b)
}

// scrapeMetrics reads url in the Prometheus text format: series (name and
// labels as written) -> value; buckets left out.
func scrapeMetrics(t *testing.T, url string) map[string]float64 {
	t.Helper()
	status, body := httpGet(t, url, "")
	require.Equal(t, http.StatusOK, status, body)
	series := map[string]float64{}
	for _, line := range strings.Split(body, "\n") {
		if line == "" || strings.HasPrefix(line, "#") || strings.Contains(line, "_bucket{") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		require.Positive(t, i, "a sample line: %q", line)
		v, err := strconv.ParseFloat(line[i+1:], 64)
		require.NoError(t, err, "a sample line: %q", line)
		series[line[:i]] = v
	}
	return series
}

// waitFor polls cond until it holds; it fails the test after timeout, or at
// once if run returned.
func waitFor(t *testing.T, done <-chan error, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		select {
		case err := <-done:
			t.Fatalf("run returned (%v) while waiting for %s", err, what)
		case <-time.After(50 * time.Millisecond):
		}
		require.True(t, time.Now().Before(deadline), "timed out waiting for %s", what)
	}
}

// TestDocsQuoteThisFile: every ```go block of docs/getting-started.md that
// follows the line <!-- examples/gettingstarted/main.go --> is a verbatim
// excerpt of this program (consecutive lines, compared without their
// leading tabs, which the page drops), so that the page and the program
// cannot drift apart; and the page quotes the configuration it leads with.
func TestDocsQuoteThisFile(t *testing.T) {
	const marker = "<!-- examples/gettingstarted/main.go -->"
	raw, err := os.ReadFile("main.go")
	require.NoError(t, err)
	program := strings.Split(strings.TrimRight(string(raw), "\n"), "\n")
	for i, l := range program {
		program[i] = strings.TrimLeft(l, "\t")
	}
	f, err := os.Open("../../docs/getting-started.md")
	require.NoError(t, err)
	defer func() { _ = f.Close() }()

	var blocks [][]string
	state := "text" // -> "marker" -> "block" -> "text"
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := sc.Text()
		switch state {
		case "text":
			if strings.TrimSpace(line) == marker {
				state = "marker"
			}
		case "marker":
			if strings.TrimSpace(line) != "```go" {
				t.Fatalf("docs/getting-started.md:%d: expected a ```go fence after %s, found %q", n, marker, line)
			}
			state, blocks = "block", append(blocks, nil)
		case "block":
			if line == "```" {
				state = "text"
				continue
			}
			blocks[len(blocks)-1] = append(blocks[len(blocks)-1], strings.TrimLeft(line, "\t"))
		}
	}
	require.NoError(t, sc.Err())
	require.Equal(t, "text", state, "docs/getting-started.md ends inside an excerpt")
	require.GreaterOrEqual(t, len(blocks), 5, "docs/getting-started.md quotes the program section by section")

	quoted := strings.Join(slices.Concat(blocks...), "\n")
	for _, must := range []string{"Batch: &exactlyonce.BatchConfig{}", "exactlyonce.Exec(", "rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: amqpURL, Prefetch: 256", "outbox.NewRelay(",
		"metrics.New(", "OnEvent: m.OnEvent", "console.Mount(", "console.BearerToken(", "relay.RunWith("} {
		require.Contains(t, quoted, must, "the page quotes the configuration it leads with")
	}
	for i, block := range blocks {
		require.NotEmpty(t, block, "excerpt %d is empty", i+1)
		if !containsRun(program, block) {
			t.Fatalf("excerpt %d of docs/getting-started.md (starting %q) is not a run of consecutive lines of "+
				"examples/gettingstarted/main.go: copy it from the file again", i+1, block[0])
		}
	}
}

// containsRun reports whether run appears as consecutive lines of lines.
func containsRun(lines, run []string) bool {
	for i := 0; i+len(run) <= len(lines); i++ {
		match := true
		for j := range run {
			if lines[i+j] != run[j] {
				match = false
				break
			}
		}
		if match {
			return true
		}
	}
	return false
}

// TestWiringLines counts the program's wiring, as issue 30 measures it:
// the lines of main.go that hold code (not blank, not only a comment),
// outside the import declaration and outside the handler (the
// router.AddHandler call whose last argument is a func literal, from its
// first line to its closing one). It was 59 without metrics and console;
// with them it must stay within 68, half the 136 lines a new user's
// service needed. `go test -v -run TestWiringLines` prints the count.
func TestWiringLines(t *testing.T) {
	src, err := os.ReadFile("main.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "main.go", src, parser.ParseComments)
	require.NoError(t, err)
	excluded := map[int]bool{}
	exclude := func(n ast.Node) {
		for l := fset.Position(n.Pos()).Line; l <= fset.Position(n.End()).Line; l++ {
			excluded[l] = true
		}
	}
	handlers := 0
	ast.Inspect(f, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.GenDecl:
			if n.Tok == token.IMPORT {
				exclude(n)
			}
		case *ast.CallExpr:
			if sel, ok := n.Fun.(*ast.SelectorExpr); ok && sel.Sel.Name == "AddHandler" {
				if _, ok := n.Args[len(n.Args)-1].(*ast.FuncLit); ok {
					exclude(n)
					handlers++
				}
			}
		}
		return true
	})
	require.Equal(t, 1, handlers, "the handler is found")
	code := map[int]bool{} // lines with a token; comments are not tokens
	var s scanner.Scanner
	s.Init(fset.AddFile("", fset.Base(), len(src)), src, nil, 0)
	for {
		pos, tok, lit := s.Scan()
		if tok == token.EOF {
			break
		}
		if tok == token.SEMICOLON && lit == "\n" { // an inserted semicolon
			continue
		}
		first := fset.Position(pos).Line
		for l := first; l <= first+strings.Count(lit, "\n"); l++ {
			code[l] = true
		}
	}
	lines := 0
	for l := range code {
		if !excluded[l] {
			lines++
		}
	}
	t.Logf("wiring: %d code lines", lines)
	require.LessOrEqual(t, lines, 68, "the getting-started service's wiring grew past half of issue 30's 136 lines")
}
