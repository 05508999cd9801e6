package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"html"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// consumer is the router handler's name: the inbox's consumer.
const consumer = "orders"

// TestConsoleInBrowser drives the console in a headless Chromium: an
// operator logs in with the token, finds the message parked for order
// A-1042 by its metadata, looks at it, replays it once the handler is fixed,
// and the order's effect happens exactly once. A page of another origin that
// posts the console's replay and discard actions with the operator's cookie
// is refused, and its message stays parked. It writes the screenshots of
// docs/images when CONSOLE_SCREENSHOTS names a directory.
func TestConsoleInBrowser(t *testing.T) {
	chromium := requireEnvironment(t)

	// The service: a router whose handler records an effect row in the
	// message's transaction, and fails permanently while broken is set.
	db := testenv.Schema(t)
	pool := testenv.Pool(t)
	effects := pgx.Identifier{db.Schema, "effects"}.Sanitize()
	_, err := pool.Exec(context.Background(), `CREATE TABLE `+effects+` (order_id text NOT NULL, message_uuid text NOT NULL)`)
	require.NoError(t, err)
	queue := ordersQueue(t)

	var broken atomic.Bool
	broken.Store(true)
	eo, err := exactlyonce.New(exactlyonce.Config{DB: db, Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	router.AddMiddleware(eo.Middleware)
	router.AddConsumerHandler(consumer, queue, testenv.AMQPSubscriber(t, 0), func(msg *message.Message) error {
		orderID := msg.Metadata.Get("order_id")
		if err := exactlyonce.Exec(msg.Context(), `INSERT INTO `+effects+` VALUES ($1, $2)`, orderID, msg.UUID); err != nil {
			return err
		}
		if broken.Load() {
			// Rolled back with the claim; the key is parked with the message.
			return exactlyonce.Permanent(fmt.Errorf("payment provider refused order %s: card declined (code 51)", orderID))
		}
		return nil
	})
	testenv.StartRouter(t, router)

	// The relay: a replay writes the message to the outbox for its topic.
	relayPub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: testenv.AMQPURL()})
	require.NoError(t, err)
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: relayPub})
	require.NoError(t, err)
	relayCtx, stopRelay := context.WithCancel(context.Background())
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(relayCtx) }()
	t.Cleanup(func() {
		stopRelay()
		assert.NoError(t, <-relayDone)
		_ = relayPub.Close()
	})

	// Two orders fail: A-1042 is replayed through the console, B-2077 is
	// the target of the forged requests.
	pub := testenv.AMQPPublisher(t)
	order := message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":"A-1042","amount_cents":4999,"currency":"EUR","customer":"c-381"}`))
	order.Metadata.Set("order_id", "A-1042")
	order.Metadata.Set("tenant", "acme")
	other := message.NewMessage(watermill.NewUUID(), []byte(`{"order_id":"B-2077","amount_cents":1250,"currency":"EUR","customer":"c-112"}`))
	other.Metadata.Set("order_id", "B-2077")
	require.NoError(t, pub.Publish(queue, order, other))

	store, err := inbox.NewStore(db)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	testenv.Eventually(t, 10*time.Second, func() bool {
		n, err := store.CountParked(ctx, inbox.ParkedFilter{Consumer: consumer})
		return err == nil && n == 2
	}, "both orders parked")

	// The console, on the service's mux (as main mounts it), behind a
	// recorder of the POST requests it receives.
	const token = "s3cret-console-token-for-the-browser-test"
	mux, err := newMux(db, token)
	require.NoError(t, err)
	var posts postLog
	srv := httptest.NewServer(posts.wrap(mux))
	t.Cleanup(srv.Close)
	base := srv.URL + prefix

	b := newBrowser(t, chromium)
	// The parked list asks to sign in first, and comes back after it (the
	// overview is not opened before the end: its figures are computed once
	// and cached for 30 s).
	b.do(chromedp.Navigate(base + "/parked"))
	b.login(token)
	require.Equal(t, base+"/parked", b.location())

	// The parked list, searched by the order's business id.
	b.do(chromedp.SetValue(chromedp.CSS(`form#parked-search input[name="meta"]`), "order_id:A-1042"))
	b.navigatingClick(`button#search`)
	require.Contains(t, b.location(), "meta=", "the search is a GET form")
	require.Equal(t, 1, b.count(`table#parked-results tr.parked-row`), "one message matches order_id:A-1042")
	require.Contains(t, b.text(`#parked-count`), "1 message matches")
	require.Contains(t, b.text(`table#parked-results tr.parked-row`), order.UUID)

	// Its page: the payload, the metadata, the reason and the attempts.
	b.navigatingClick(`tr.parked-row a.show`)
	require.Contains(t, b.location(), prefix+"/parked/"+consumer+"/")
	require.Equal(t, string(order.Payload), strings.TrimSpace(b.text(`pre#payload`)))
	metadata := b.text(`table#metadata`)
	require.Contains(t, metadata, "order_id")
	require.Contains(t, metadata, "A-1042")
	require.Contains(t, metadata, "tenant")
	require.Contains(t, b.text(`#reason`), "card declined (code 51)")
	require.Contains(t, b.text(`#attempts`), "1")
	b.screenshot("console-message.png")

	// Replay: a confirmation page first, then the action.
	b.navigatingClick(`form#replay-form [type="submit"]`)
	require.Contains(t, b.text(`#confirm-count`), "This replays 1 message.")
	broken.Store(false) // the payment provider is fixed
	b.navigatingClick(`button#confirm`)
	require.Contains(t, b.text(`#result`), "Replayed 1 message")

	// The order's effect happens once: the relay publishes the message, the
	// router processes it. A redelivery of the original is a duplicate.
	countEffects := func() int64 {
		return testenv.Count(t, db.Conn, `SELECT count(*) FROM `+effects+` WHERE order_id = 'A-1042'`)
	}
	testenv.Eventually(t, 15*time.Second, func() bool { return countEffects() >= 1 }, "the replayed order processed")
	require.NoError(t, pub.Publish(queue, order.Copy()))
	for deadline := time.Now().Add(3 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		require.EqualValues(t, 1, countEffects(), "order A-1042's effect rows")
	}
	require.EqualValues(t, 1, testenv.Count(t, db.Conn, `SELECT count(*) FROM `+effects+` WHERE message_uuid = $1`, order.UUID),
		"the replay carries the message's UUID")
	rec, err := store.Get(ctx, consumer, order.UUID)
	require.NoError(t, err)
	require.Equal(t, "done", rec.Status)
	_, err = store.GetParked(ctx, consumer, order.UUID)
	require.ErrorIs(t, err, inbox.ErrNotParked)

	// Forged requests: a page of another origin (another port: the browser
	// sends Sec-Fetch-Site: same-site, and the console's cookie, SameSite
	// Strict, with it) posts the replay and the discard of B-2077.
	b.do(chromedp.Navigate(base + "/parked/" + consumer + "/" + other.UUID))
	forgeries := []form{b.form(`form#replay-form`), b.form(`form#discard-form`)}
	b.navigatingClick(`form#replay-form [type="submit"]`)
	forgeries = append(forgeries, b.form(`#confirm`))
	b.do(chromedp.Navigate(base + "/parked/" + consumer + "/" + other.UUID))
	b.navigatingClick(`form#discard-form [type="submit"]`)
	forgeries = append(forgeries, b.form(`#confirm`))

	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var f form
		if err := json.Unmarshal([]byte(r.URL.Query().Get("form")), &f); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		_, _ = fmt.Fprintf(w, `<!doctype html><title>You won a prize</title><form id="f" method="post" action="%s">`, html.EscapeString(f.Action))
		for _, field := range f.Fields {
			_, _ = fmt.Fprintf(w, `<input type="hidden" name="%s" value="%s">`, html.EscapeString(field[0]), html.EscapeString(field[1]))
		}
		_, _ = fmt.Fprint(w, `</form><script>document.getElementById("f").submit()</script>`)
	}))
	t.Cleanup(evil.Close)
	require.NotEqual(t, srv.URL, evil.URL)

	for _, f := range forgeries {
		posts.reset()
		raw, err := json.Marshal(f)
		require.NoError(t, err)
		b.do(chromedp.Navigate(evil.URL + "/?form=" + url.QueryEscape(string(raw))))
		testenv.Eventually(t, 10*time.Second, func() bool { return len(posts.all()) > 0 }, "the forged POST to %s reached the console", f.Action)
		for _, p := range posts.all() {
			t.Logf("forged POST %s: Sec-Fetch-Site %q, cookie sent: %v, answered %d", p.path, p.fetchSite, p.cookie, p.status)
			require.NotEqual(t, "same-origin", p.fetchSite, "forged POST %s", p.path)
			require.True(t, p.cookie, "the browser sent the console's cookie with the forged POST %s", p.path)
			require.Equal(t, http.StatusForbidden, p.status, "forged POST %s (Sec-Fetch-Site %q)", p.path, p.fetchSite)
		}
	}
	msg, err := store.GetParked(ctx, consumer, other.UUID)
	require.NoError(t, err, "B-2077 is still parked after the forged requests")
	require.Equal(t, "parked", msg.Status)
	require.True(t, msg.PayloadKept)
	require.Zero(t, testenv.Count(t, db.Conn, `SELECT count(*) FROM `+db.Outbox()+` WHERE uuid = $1`, other.UUID), "B-2077 in the outbox")
	require.Zero(t, testenv.Count(t, db.Conn, `SELECT count(*) FROM `+effects+` WHERE order_id = 'B-2077'`), "B-2077's effect rows")

	// The overview, last: one consumer with a message processed and one
	// parked. Its figures are computed in the background: the first request
	// starts it, the page shows them once they are there.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		b.do(chromedp.Navigate(base + "/"))
		if b.count(`table#consumers tr.consumer-row`) > 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "the overview shows no figures after 10 s")
	}
	row := `table#consumers tr.consumer-row[data-consumer="` + consumer + `"]`
	require.Equal(t, "1", b.text(row+` [data-field="done"]`), "processed")
	require.Equal(t, "1", strings.Fields(b.text(row + ` [data-field="parked"]`))[0], "parked keys") // then a hidden label
	require.NotEmpty(t, b.text(`#outbox`))
	require.NotEmpty(t, b.text(`#as-of`))
	b.screenshot("console-overview.png")
}

// ordersQueue declares a durable queue with a unique name that reads well
// in the screenshots (the message page shows it as the topic), deleted at
// cleanup.
func ordersQueue(t *testing.T) string {
	t.Helper()
	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	name := "shop.orders." + hex.EncodeToString(suffix)
	ch, err := testenv.AMQPConn(t).Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(name, true, false, false, false, nil)
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := ch.QueueDelete(name, false, false, false)
		assert.NoError(t, err, "deleting queue %s", name)
		_ = ch.Close()
	})
	return name
}

// requireEnvironment returns the path of Chromium after checking that it,
// PostgreSQL and RabbitMQ are there: when one is missing the test skips, or
// fails when CI=true.
func requireEnvironment(t *testing.T) string {
	t.Helper()
	var missing []string
	chromium, err := chromiumPath()
	if err != nil {
		missing = append(missing, err.Error())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
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
		return chromium
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("missing (`make services` installs and starts them): %s", strings.Join(missing, "; "))
	}
	t.Skipf("missing (run `make services`, or set DATABASE_URL / AMQP_URL): %s", strings.Join(missing, "; "))
	return ""
}

// chromiumPath finds the system's Chromium: chromium (Debian) or
// chromium-browser, in PATH.
func chromiumPath() (string, error) {
	for _, name := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(name); err == nil {
			return p, nil
		}
	}
	return "", errors.New("chromium: neither chromium nor chromium-browser is in PATH")
}

// browser is a headless Chromium tab, with the test's helpers. Each of
// them fails the test on an error, and gives up after 15 s.
type browser struct {
	t   *testing.T
	ctx context.Context
}

func newBrowser(t *testing.T, execPath string) *browser {
	t.Helper()
	opts := append(chromedp.DefaultExecAllocatorOptions[:], chromedp.ExecPath(execPath), chromedp.WindowSize(1280, 800))
	if os.Geteuid() == 0 {
		opts = append(opts, chromedp.NoSandbox) // Chromium refuses to run as root with its sandbox
	}
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancelTab := chromedp.NewContext(allocCtx)
	t.Cleanup(func() { cancelTab(); cancelAlloc() })
	// The first call starts the browser, for the life of ctx: no timeout on it.
	require.NoError(t, chromedp.Do(ctx), "starting %s", execPath)
	return &browser{t: t, ctx: ctx}
}

func runIn[T any](b *browser, a chromedp.Action[T]) T {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, 15*time.Second)
	defer cancel()
	v, err := chromedp.Run(ctx, a)
	require.NoError(b.t, err)
	return v
}

func (b *browser) do(steps ...chromedp.Action[chromedp.Void]) {
	b.t.Helper()
	runIn(b, chromedp.Steps(steps...))
}

// login fills in the console's login form with the token and submits it.
func (b *browser) login(token string) {
	b.t.Helper()
	b.do(chromedp.SetValue(chromedp.CSS(`form#login input#token`), token))
	b.navigatingClick(`form#login button#sign-in`)
}

// navigatingClick clicks the element sel selects and waits until the page
// it leads to has loaded.
func (b *browser) navigatingClick(sel string) {
	b.t.Helper()
	b.do(chromedp.Evaluate[chromedp.Void](`window.__beforeClick = true`))
	runIn(b, chromedp.WaitEvent(page.LoadEventFired, nil, chromedp.Click(chromedp.CSS(sel), chromedp.NodeVisible)))
	left := runIn(b, chromedp.Evaluate[bool](`window.__beforeClick === undefined`))
	require.True(b.t, left, "clicking %s led to another page", sel)
}

func (b *browser) location() string {
	b.t.Helper()
	return runIn(b, chromedp.Location())
}

// text is the text of the first element sel selects (waiting for it).
func (b *browser) text(sel string) string {
	b.t.Helper()
	return runIn(b, chromedp.Text(chromedp.CSS(sel)))
}

func (b *browser) count(sel string) int {
	b.t.Helper()
	return runIn(b, chromedp.Evaluate[int](fmt.Sprintf(`document.querySelectorAll(%q).length`, sel)))
}

// form is a form of the console as a forged copy needs it: its absolute
// action and its fields (name, value), hidden ones included.
type form struct {
	Action string
	Fields [][2]string
}

// form reads the form sel selects (or the form of the button it selects).
func (b *browser) form(sel string) form {
	b.t.Helper()
	b.do(chromedp.WaitReady(chromedp.CSS(sel)))
	f := runIn(b, chromedp.Evaluate[form](fmt.Sprintf(`(() => {
		const el = document.querySelector(%q);
		const f = el instanceof HTMLFormElement ? el : el.form;
		return {Action: f.action, Fields: Array.from(f.elements).filter(e => e.name && e.type !== "submit").map(e => [e.name, e.value])};
	})()`, sel)))
	require.NotEmpty(b.t, f.Action, "form %s", sel)
	return f
}

// screenshot takes a full-page PNG, and writes it to $CONSOLE_SCREENSHOTS
// when set.
func (b *browser) screenshot(name string) {
	b.t.Helper()
	png := runIn(b, chromedp.FullScreenshot(100))
	require.NotEmpty(b.t, png)
	if dir := os.Getenv("CONSOLE_SCREENSHOTS"); dir != "" {
		require.NoError(b.t, os.WriteFile(filepath.Join(dir, name), png, 0o644))
	}
}

// postLog records the POST requests a handler receives.
type postLog struct {
	mu    sync.Mutex
	posts []post
}

type post struct {
	path      string
	fetchSite string // the Sec-Fetch-Site header
	cookie    bool   // the request carried a cookie
	status    int
}

func (l *postLog) wrap(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			h.ServeHTTP(w, r)
			return
		}
		sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
		h.ServeHTTP(sw, r)
		l.mu.Lock()
		defer l.mu.Unlock()
		l.posts = append(l.posts, post{path: r.URL.Path, fetchSite: r.Header.Get("Sec-Fetch-Site"), cookie: len(r.Cookies()) > 0, status: sw.status})
	})
}

func (l *postLog) reset() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.posts = nil
}

func (l *postLog) all() []post {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]post(nil), l.posts...)
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}
