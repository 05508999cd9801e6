package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The notifier binary is built once per test run (with -race, so that a data
// race inside the service fails the test through its exit status and its
// "WARNING: DATA RACE" report) and removed by TestMain.
var notifierBin struct {
	once sync.Once
	dir  string
	path string
	out  []byte
	err  error
}

func notifierBinary(t *testing.T) string {
	t.Helper()
	notifierBin.once.Do(func() {
		notifierBin.dir, notifierBin.err = os.MkdirTemp("", "notifier-e2e-")
		if notifierBin.err != nil {
			return
		}
		notifierBin.path = filepath.Join(notifierBin.dir, "notifier")
		goCmd := os.Getenv("GO")
		if goCmd == "" {
			goCmd = "go"
		}
		cmd := exec.Command(goCmd, "build", "-race", "-o", notifierBin.path, ".")
		notifierBin.out, notifierBin.err = cmd.CombinedOutput()
	})
	require.NoError(t, notifierBin.err, "building the notifier:\n%s", notifierBin.out)
	return notifierBin.path
}

func removeNotifierBinary() {
	if notifierBin.dir != "" {
		_ = os.RemoveAll(notifierBin.dir)
	}
}

// syncBuffer collects the subprocess's output; written by exec's copying
// goroutine, read by the test.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// notifierProc is one notifier subprocess with its own schema, queues and
// fake providers.
type notifierProc struct {
	t      *testing.T
	cmd    *exec.Cmd
	out    *syncBuffer
	done   chan struct{} // closed when the process has exited
	exit   error         // cmd.Wait's result, readable after done
	base   string        // http://127.0.0.1:port
	client *http.Client

	databaseURL string        // the notifier's DATABASE_URL
	db          wsql.Beginner // the test's own connection to the notifier's database
	tables      sqlschema.DB  // the notifier's schema (Dialect set), through db

	send, sent, dead string
	sms, email       *testenv.Provider

	ch *amqp.Channel // publisher confirms on; also used for Get and passive declares
}

type notifierOptions struct {
	// sms and email are the providers (default: fresh ones answering 200).
	// Set their OnRequest before passing them.
	sms, email *testenv.Provider
	// same, when set, makes this a second instance of that notifier: the
	// same database schema, queues and providers.
	same *notifierProc
	// engine is the database: "postgres" (the default) or testenv.MariaDB.
	engine string
}

// e2eEngines are the database engines an end-to-end test runs on, as
// parallel subtests named after them (notifierOptions.engine).
var e2eEngines = []string{"postgres", testenv.MariaDB}

// forEachEngine runs f once per database engine, as parallel subtests.
func forEachEngine(t *testing.T, f func(t *testing.T, engine string)) {
	for _, e := range e2eEngines {
		t.Run(e, func(t *testing.T) {
			t.Parallel()
			f(t, e)
		})
	}
}

var runningLine = regexp.MustCompile(`msg="notifier running" http="?([0-9a-fA-F.:\[\]]+)`)

// startNotifier starts the notifier binary on its own schema and queues with
// HTTP_ADDR=127.0.0.1:0, reads the address it chose from its log, and waits
// until /healthz answers 200. At cleanup the process is killed if still
// running, its output is logged if the test failed, and a data race report
// in it fails the test.
func startNotifier(t *testing.T, opts notifierOptions) *notifierProc {
	t.Helper()
	bin := notifierBinary(t)
	n := &notifierProc{
		t:      t,
		out:    &syncBuffer{},
		done:   make(chan struct{}),
		client: &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}},
		sms:    opts.sms,
		email:  opts.email,
	}
	if n.sms == nil {
		n.sms = testenv.NewProvider(t)
	}
	if n.email == nil {
		n.email = testenv.NewProvider(t)
	}

	n.databaseURL = testenv.DatabaseURL()
	if o := opts.same; o != nil {
		n.db, n.databaseURL = o.db, o.databaseURL
		n.tables, n.send, n.sent, n.dead, n.sms, n.email = o.tables, o.send, o.sent, o.dead, o.sms, o.email
	} else {
		drop := "DROP SCHEMA IF EXISTS %s CASCADE"
		switch opts.engine {
		case "", "postgres":
			n.db = wsql.BeginnerFromPgx(testenv.Pool(t))
			n.tables = sqlschema.DB{Conn: n.db, Schema: testenv.Unique(t, "nt_")}
		case testenv.MariaDB:
			n.databaseURL, drop = testenv.MySQLURL(), "DROP DATABASE IF EXISTS %s"
			n.db = wsql.BeginnerFromStdSQL(testenv.MySQLDB(t))
			n.tables = sqlschema.DB{Conn: n.db, Dialect: sqlschema.MySQL, Schema: testenv.Unique(t, "nt_")}
		default:
			t.Fatalf("no database engine %q", opts.engine)
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if _, err := n.db.ExecContext(ctx, fmt.Sprintf(drop, n.tables.Dialect.QuoteIdentifier(n.tables.Schema))); err != nil {
				t.Errorf("dropping schema %s: %v", n.tables.Schema, err)
			}
		})
		n.send = testenv.Queue(t, "ntsend_")
		n.sent = testenv.Queue(t, "ntsent_")
		n.dead = testenv.Queue(t, "ntdead_")
	}

	var err error
	n.ch, err = testenv.AMQPConn(t).Channel()
	require.NoError(t, err)
	require.NoError(t, n.ch.Confirm(false))

	n.cmd = exec.Command(bin)
	n.cmd.Env = append(os.Environ(),
		"DATABASE_URL="+n.databaseURL,
		"AMQP_URL="+testenv.AMQPURL(),
		"SMS_PROVIDER_URL="+n.sms.URL(),
		"EMAIL_PROVIDER_URL="+n.email.URL(),
		"HTTP_ADDR=127.0.0.1:0",
		"WORKERS=4",
		"INBOX_LEASE=5s",
		"RELAY=on",
		"METRICS_INBOX_INTERVAL=200ms",
		"DB_SCHEMA="+n.tables.Schema,
		"SEND_QUEUE="+n.send,
		"SENT_QUEUE="+n.sent,
		"DEAD_QUEUE="+n.dead,
	)
	n.cmd.Stdout = n.out
	n.cmd.Stderr = n.out
	require.NoError(t, n.cmd.Start())
	go func() {
		n.exit = n.cmd.Wait()
		close(n.done)
	}()
	t.Cleanup(func() {
		select {
		case <-n.done:
		default:
			_ = n.cmd.Process.Kill()
			select {
			case <-n.done:
			case <-time.After(10 * time.Second):
				t.Errorf("notifier pid %d did not exit after SIGKILL", n.cmd.Process.Pid)
			}
		}
		out := n.out.String()
		if strings.Contains(out, "WARNING: DATA RACE") {
			t.Errorf("the notifier reported a data race")
		}
		if t.Failed() {
			t.Logf("notifier output:\n%s", out)
		}
	})

	// The address it listens on, from its "notifier running" log line.
	deadline := time.Now().Add(60 * time.Second)
	for {
		if m := runningLine.FindStringSubmatch(n.out.String()); m != nil {
			n.base = "http://" + m[1]
			break
		}
		select {
		case <-n.done:
			t.Fatalf("the notifier exited before running: %v", n.exit)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatal("the notifier did not log `notifier running` within 60s")
		}
	}
	n.waitFor(20*time.Second, "/healthz to answer 200", func() (bool, string) {
		code, body := n.get("/healthz")
		return code == http.StatusOK, fmt.Sprintf("%d %s", code, body)
	})
	return n
}

// waitFor polls cond until it holds, failing the test after timeout with the
// last state cond described, or at once if the notifier exits.
func (n *notifierProc) waitFor(timeout time.Duration, what string, cond func() (bool, string)) {
	n.t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		ok, state := cond()
		if ok {
			return
		}
		select {
		case <-n.done:
			n.t.Fatalf("the notifier exited (%v) while waiting for %s; last state: %s", n.exit, what, state)
		default:
		}
		if time.Now().After(deadline) {
			n.t.Fatalf("timed out after %s waiting for %s; last state: %s", timeout, what, state)
		}
		time.Sleep(20 * time.Millisecond) // poll interval
	}
}

// stop sends SIGTERM and requires a clean exit (status 0) within bound.
func (n *notifierProc) stop(bound time.Duration) {
	n.t.Helper()
	require.NoError(n.t, n.cmd.Process.Signal(syscall.SIGTERM))
	select {
	case <-n.done:
	case <-time.After(bound):
		n.t.Fatalf("the notifier did not exit within %s of SIGTERM", bound)
	}
	require.NoError(n.t, n.exit, "the notifier must exit 0 after SIGTERM")
	require.Equal(n.t, 0, n.cmd.ProcessState.ExitCode())
	require.Contains(n.t, n.out.String(), "shutting down: finishing in-flight messages")
}

func (n *notifierProc) do(method, path, contentType string, body []byte) (int, []byte, http.Header) {
	n.t.Helper()
	req, err := http.NewRequest(method, n.base+path, bytes.NewReader(body))
	require.NoError(n.t, err)
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	resp, err := n.client.Do(req)
	require.NoError(n.t, err, "%s %s", method, path)
	defer func() { _ = resp.Body.Close() }()
	b, err := io.ReadAll(resp.Body)
	require.NoError(n.t, err)
	return resp.StatusCode, b, resp.Header
}

func (n *notifierProc) get(path string) (int, []byte) {
	code, body, _ := n.do(http.MethodGet, path, "", nil)
	return code, body
}

func (n *notifierProc) post(path, body string) (int, []byte) {
	code, b, _ := n.do(http.MethodPost, path, "application/json", []byte(body))
	return code, b
}

// getJSON requires 200 with a JSON content type and decodes the body into v.
func (n *notifierProc) getJSON(path string, v any) {
	n.t.Helper()
	code, body, h := n.do(http.MethodGet, path, "", nil)
	require.Equal(n.t, http.StatusOK, code, "GET %s: %s", path, body)
	require.Equal(n.t, "application/json", h.Get("Content-Type"), "GET %s", path)
	require.NoError(n.t, json.Unmarshal(body, v), "GET %s: %s", path, body)
}

// metrics scrapes /metrics into series -> value, e.g.
// `exactlyonce_deliveries_total{consumer="notifier-send",outcome="duplicate"}` -> 15.
func (n *notifierProc) metrics() map[string]float64 {
	n.t.Helper()
	code, body := n.get("/metrics")
	require.Equal(n.t, http.StatusOK, code, "GET /metrics: %s", body)
	out := map[string]float64{}
	sc := bufio.NewScanner(bytes.NewReader(body))
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		require.Positive(n.t, i, "metrics line %q", line)
		v, err := strconv.ParseFloat(line[i+1:], 64)
		require.NoError(n.t, err, "metrics line %q", line)
		out[line[:i]] = v
	}
	require.NoError(n.t, sc.Err())
	return out
}

// metric is one series' value; a labelled counter never incremented is
// absent from the scrape and reads as 0.
func (n *notifierProc) metric(series string) float64 {
	n.t.Helper()
	return n.metrics()[series]
}

const (
	seriesDuplicates = `exactlyonce_deliveries_total{consumer="notifier-send",outcome="duplicate"}`
	seriesProcessed  = `exactlyonce_deliveries_total{consumer="notifier-send",outcome="processed"}`
	seriesTakeovers  = `exactlyonce_lease_takeovers_total{consumer="notifier-send"}`
	seriesBusy       = `exactlyonce_delivery_errors_total{consumer="notifier-send",reason="lease_held"}`
	seriesParked     = `exactlyonce_inbox_rows{consumer="notifier-send",status="parked"}`
)

// publish publishes to the send queue with a plain AMQP client (no
// Watermill) and waits for every publisher confirm.
func (n *notifierProc) publish(msgs ...amqp.Publishing) {
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	confirms := make([]*amqp.DeferredConfirmation, 0, len(msgs))
	for _, m := range msgs {
		if m.DeliveryMode == 0 {
			m.DeliveryMode = amqp.Persistent
		}
		dc, err := n.ch.PublishWithDeferredConfirmWithContext(ctx, "", n.send, false, false, m)
		require.NoError(n.t, err)
		confirms = append(confirms, dc)
	}
	for _, dc := range confirms {
		acked, err := dc.WaitContext(ctx)
		require.NoError(n.t, err)
		require.True(n.t, acked, "RabbitMQ nacked a publish")
	}
}

// request is a send request as a producer publishes it: message_id set, JSON body.
func request(messageID string, r SendRequest) amqp.Publishing {
	body, err := json.Marshal(r)
	if err != nil {
		panic(err)
	}
	return amqp.Publishing{MessageId: messageID, ContentType: "application/json", Body: body}
}

// depth is the number of ready messages in queue.
func (n *notifierProc) depth(queue string) int {
	n.t.Helper()
	q, err := n.ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(n.t, err)
	return q.Messages
}

// drain takes every ready message from queue (basic.get, auto-ack).
func (n *notifierProc) drain(queue string) []amqp.Delivery {
	n.t.Helper()
	var out []amqp.Delivery
	for {
		d, ok, err := n.ch.Get(queue, true)
		require.NoError(n.t, err)
		if !ok {
			return out
		}
		out = append(out, d)
	}
}

type logRow struct {
	NotificationID, Channel, Recipient, Status, MessageKey string
	Attempts                                               int
}

// logRows reads the notifier's notification_log in the test schema.
func (n *notifierProc) logRows() map[string]logRow {
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rows, err := n.db.QueryContext(ctx, `SELECT notification_id, channel, recipient, status, attempts, message_key FROM `+
		n.tables.Dialect.QuoteIdentifier(n.tables.Schema, "notification_log"))
	require.NoError(n.t, err)
	defer func() { _ = rows.Close() }()
	out := map[string]logRow{}
	for rows.Next() {
		var r logRow
		require.NoError(n.t, rows.Scan(&r.NotificationID, &r.Channel, &r.Recipient, &r.Status, &r.Attempts, &r.MessageKey))
		out[r.NotificationID] = r
	}
	require.NoError(n.t, rowsErr(rows))
	return out
}

// inboxRows counts the inbox records of consumer.
func (n *notifierProc) inboxRows(consumer string) int {
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var c int
	query := `SELECT count(*) FROM ` + n.tables.Inbox() + ` WHERE consumer = $1`
	if n.tables.Dialect == sqlschema.MySQL {
		query = `SELECT count(*) FROM ` + n.tables.Inbox() + ` WHERE consumer = ?`
	}
	found, err := queryRow(ctx, n.db, query, []any{consumer}, &c)
	require.NoError(n.t, err)
	require.True(n.t, found)
	return c
}

// pending is the number of unrelayed outbox rows.
func (n *notifierProc) pending() int64 {
	n.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rows, err := outbox.NewStore(n.tables)
	require.NoError(n.t, err)
	p, err := rows.Pending(ctx)
	require.NoError(n.t, err)
	return p.Count
}

// providerCalls merges both providers' calls per idempotency key.
func (n *notifierProc) providerCalls() (sms, email map[string]int) {
	return n.sms.AllCalls(), n.email.AllCalls()
}
