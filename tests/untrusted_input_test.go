package tests

// Untrusted input: messages and configuration an attacker, a buggy
// producer or a careless operator can send. Every test runs a real Watermill
// router on RabbitMQ with the exactly-once middleware (both modes where the
// mode changes the code path, both drivers where the database is involved)
// and checks for each: a clear error or a dead letter with its
// reason, no crash, nothing else blocked (a good message published after the
// bad ones is processed), nothing lost.
//
// Helpers of this file start with "hostile".

import (
	"context"
	"crypto/rand"
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// hostileCaseHeader names each hostile message, so that a test can tell
// which one reached the poison queue or the output queue.
const hostileCaseHeader = "hostile-case"

// hostileKeyHeader is the metadata field of KeyFromMetadata in these tests.
const hostileKeyHeader = "idempotency-key"

// hostileEachDriverMode runs f as parallel subtests, once per driver and
// mode (testenv.ForEachDriver with the modes as variants; lease: lease
// mode, else transactional).
func hostileEachDriverMode(t *testing.T, f func(t *testing.T, d testenv.Driver, lease bool)) {
	t.Helper()
	testenv.ForEachDriver(t, []string{"transactional", "lease"}, func(t *testing.T, d testenv.Driver, mode string) {
		f(t, d, mode == "lease")
	})
}

// hostileEnv is one test's world: the e2e bundle, the input's poison
// queue, and what the handler saw.
type hostileEnv struct {
	*e2e
	poison           string
	mu               sync.Mutex
	handled          []string // keys the handler saw, in order
	handledConsumers []string
}

func hostileSetup(t *testing.T, d testenv.Driver) *hostileEnv {
	t.Helper()
	e := &hostileEnv{e2e: setupE2E(t, d)}
	e.poison = e.In + "_poison" // deleted by testenv.Queue's cleanup of In
	declareQueue(t, e.Conn, e.poison)
	return e
}

// middleware returns the exactly-once middleware on e's database and
// tables, in lease mode when lease is set, keyed by key (nil: the message
// UUID).
func (e *hostileEnv) middleware(t testing.TB, lease bool, key func(*message.Message) (string, error)) *exactlyonce.Guard {
	t.Helper()
	cfg := exactlyonce.Config{Key: key, NackDelay: -1}
	if lease {
		cfg.Lease = &exactlyonce.LeaseConfig{}
	}
	return e.Middleware(t, cfg)
}

// handler records the key and consumer it runs for and writes one effect
// row through the middleware's transaction. out, when not nil, makes the
// handler's output messages.
func (e *hostileEnv) handler(out func(msg *message.Message) []*message.Message) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		info, err := exactlyonce.InfoFromContext(ctx)
		if err != nil {
			return nil, err
		}
		key := info.Key
		e.mu.Lock()
		e.handled = append(e.handled, key)
		e.handledConsumers = append(e.handledConsumers, info.Consumer)
		e.mu.Unlock()
		if err := e.Effects.Insert(ctx, key, 1); err != nil {
			return nil, err
		}
		if out == nil {
			return nil, nil
		}
		return out(msg), nil
	}
}

func (e *hostileEnv) handledKeys() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]string(nil), e.handled...)
}

// hostilePoisonFilter is the poison-queue filter the docs recommend:
// exactlyonce.IsPermanent, true for the errors that never succeed on retry,
// the key errors among them.
func hostilePoisonFilter(err error) bool { return exactlyonce.IsPermanent(err) }

// hostileIsKeyError reports whether err is a key rejection: every key
// error wraps exactlyonce.ErrInvalidKey, and the poison filter takes it.
func hostileIsKeyError(err error) bool {
	return errors.Is(err, exactlyonce.ErrInvalidKey) && hostilePoisonFilter(err)
}

// startRouter runs a router with one handler named name consuming e.In
// (prefetch 1, so deliveries are handled in queue order) with the
// exactly-once middleware inside a poison queue (filter nil: no poison
// queue), and the handler's publish topic e.Out.
func (e *hostileEnv) startRouter(t testing.TB, name string, eo *exactlyonce.Guard, filter func(error) bool, sub message.Subscriber, h message.HandlerFunc) *message.Router {
	t.Helper()
	r := newRouter(t)
	if filter != nil {
		pq, err := wmiddleware.PoisonQueueWithFilter(e.Pub, e.poison, filter)
		require.NoError(t, err)
		r.AddMiddleware(pq)
	}
	r.AddMiddleware(eo.Middleware)
	if sub == nil {
		sub = testenv.AMQPSubscriber(t, 1)
	}
	r.AddHandler(name, e.In, sub, e.Out, outboxOnly(t), h)
	testenv.StartRouter(t, r)
	return r
}

// drainPoison waits until want messages arrived in e.poison and
// returns them by their hostile-case header. It fails on a message without
// the header or on a repeat.
func (e *hostileEnv) drainPoison(t testing.TB, want int) map[string]amqp.Delivery {
	t.Helper()
	var got []amqp.Delivery
	testenv.Eventually(t, waitTimeout, func() bool {
		got = append(got, drainQueue(t, e.Conn, e.poison)...)
		return len(got) >= want
	}, "expected %d message(s) in the poison queue", want)
	out := map[string]amqp.Delivery{}
	for _, d := range got {
		name, _ := d.Headers[hostileCaseHeader].(string)
		require.NotEmpty(t, name, "poisoned message without the %s header: %v", hostileCaseHeader, d.Headers)
		_, dup := out[name]
		require.False(t, dup, "case %q poisoned twice", name)
		out[name] = d
	}
	require.Len(t, out, want)
	return out
}

// inboxRows counts the inbox rows of the test schema.
func (e *hostileEnv) inboxRows(t testing.TB) int64 {
	t.Helper()
	return e.Count(t, `SELECT count(*) FROM `+e.DB.Inbox())
}

// ---------------------------------------------------------------------------
// Keys that cannot be stored: empty, too long, not UTF-8, with NUL.

// hostileBadKey is a message whose key the middleware must reject.
type hostileBadKey struct {
	name string
	// publish sends the message to queue.
	publish func(t testing.TB, e *hostileEnv)
	// want is the sentinel the rejection wraps; reason a text the poison
	// reason must contain.
	want   error
	reason string
	// key is the hostile key (KeyFromMetadata: the header's value, which
	// must reach the poison queue byte for byte).
	key string
}

func hostileKeyCases(fromMetadata bool) []hostileBadKey {
	long := strings.Repeat("k", 10<<10)
	viaWatermill := func(name, key string) func(testing.TB, *hostileEnv) {
		return func(t testing.TB, e *hostileEnv) {
			var msg *message.Message
			if fromMetadata {
				msg = message.NewMessage(watermill.NewUUID(), []byte(`{"case":"`+name+`"}`))
				msg.Metadata.Set(hostileKeyHeader, key)
			} else {
				msg = message.NewMessage(key, []byte(`{"case":"`+name+`"}`))
			}
			msg.Metadata.Set(hostileCaseHeader, name)
			require.NoError(t, e.Pub.Publish(e.In, msg))
		}
	}
	cases := []hostileBadKey{
		{"empty", viaWatermill("empty", ""), inboxdb.ErrEmptyKey, "invalid message key: empty", ""},
		{"10KB", viaWatermill("10KB", long), inboxdb.ErrKeyTooLong, "message key: too long: 10240 bytes, the limit is 1024", long},
		{"not UTF-8", viaWatermill("not UTF-8", "key-\xff\xfe-\xc3"), exactlyonce.ErrInvalidKey, "not valid UTF-8", "key-\xff\xfe-\xc3"},
		{"NUL", viaWatermill("NUL", "key\x00with-nul"), exactlyonce.ErrInvalidKey, "contains a NUL byte", "key\x00with-nul"},
	}
	if fromMetadata {
		cases = append(cases, hostileBadKey{"header missing", func(t testing.TB, e *hostileEnv) {
			msg := message.NewMessage(watermill.NewUUID(), []byte(`{"case":"header missing"}`))
			msg.Metadata.Set(hostileCaseHeader, "header missing")
			require.NoError(t, e.Pub.Publish(e.In, msg))
		}, inboxdb.ErrEmptyKey, "invalid message key: empty", ""})
		return cases
	}
	// No identity at all: a non-Watermill producer without the UUID header
	// and without message_id; and one with message_id only, which
	// watermill-amqp's DefaultMarshaler ignores.
	cases = append(cases,
		hostileBadKey{"no identity", func(t testing.TB, e *hostileEnv) {
			publishRaw(t, e.Conn, e.In, amqp.Publishing{
				Headers: amqp.Table{hostileCaseHeader: "no identity"}, Body: []byte(`{"case":"no identity"}`),
			})
		}, inboxdb.ErrEmptyKey, "set a UUID on the message", ""},
		hostileBadKey{"message_id only", func(t testing.TB, e *hostileEnv) {
			publishRaw(t, e.Conn, e.In, amqp.Publishing{
				MessageId: "php-42", Headers: amqp.Table{hostileCaseHeader: "message_id only"}, Body: []byte(`{"case":"message_id only"}`),
			})
		}, inboxdb.ErrEmptyKey, "message_id", ""},
	)
	return cases
}

// Keys the inbox cannot store (empty, 10 KB, not UTF-8, with a NUL byte, no
// identity at all), through the UUID and KeyFromMetadata, in both modes
// and with both drivers: each is rejected with its sentinel before any
// claim, dead-lettered with the reason by the recommended poison-queue
// filter, the handler never runs for it, and a good message published after
// all of them is processed (and its duplicate recognised).
func TestUnstorableKeysAreDeadLettered(t *testing.T) {
	t.Parallel()
	for _, source := range []string{"uuid", "metadata"} {
		t.Run(source, func(t *testing.T) {
			t.Parallel()
			hostileEachDriverMode(t, func(t *testing.T, d testenv.Driver, lease bool) {
				hostileKeysRun(t, d, lease, source == "metadata")
			})
		})
	}
}

func hostileKeysRun(t *testing.T, d testenv.Driver, lease bool, fromMetadata bool) {
	e := hostileSetup(t, d)
	var key func(*message.Message) (string, error)
	if fromMetadata {
		key = exactlyonce.KeyFromMetadata(hostileKeyHeader)
	}
	eo := e.middleware(t, lease, key)
	const handlerName = "hostile-keys"
	r := e.startRouter(t, handlerName, eo, hostilePoisonFilter, nil, e.handler(nil))

	cases := hostileKeyCases(fromMetadata)
	for _, c := range cases {
		c.publish(t, e)
	}
	// The good message, published after every bad one, twice.
	goodKey := "good-" + watermill.NewUUID()
	for range 2 {
		good := message.NewMessage(goodKey, []byte(`{"case":"good"}`))
		if fromMetadata {
			good.UUID = watermill.NewUUID()
			good.Metadata.Set(hostileKeyHeader, goodKey)
		}
		require.NoError(t, e.Pub.Publish(e.In, good))
	}

	testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Settled() >= 2 },
		"the good message behind the hostile ones was not processed")
	poisoned := e.drainPoison(t, len(cases))
	require.NoError(t, r.Close())
	requireQueueSettled(t, e.Conn, e.In, 0)
	require.Empty(t, drainQueue(t, e.Conn, e.poison), "each hostile message is poisoned once")

	for _, c := range cases {
		p, ok := poisoned[c.name]
		require.True(t, ok, "case %q not in the poison queue", c.name)
		reason, _ := p.Headers[wmiddleware.ReasonForPoisonedKey].(string)
		require.Contains(t, reason, c.want.Error(), "case %q", c.name)
		require.Contains(t, reason, c.reason, "case %q", c.name)
		require.Contains(t, reason, `handler "`+handlerName+`"`, "case %q: the reason names the handler", c.name)
		require.Equal(t, handlerName, p.Headers[wmiddleware.PoisonedHandlerKey], "case %q", c.name)
		require.Equal(t, `{"case":"`+c.name+`"}`, string(p.Body), "case %q: the body is kept", c.name)
		// The hostile key itself travels on to the poison queue, byte for
		// byte.
		raw, present := p.Headers[hostileKeyHeader].(string)
		switch {
		case fromMetadata && c.name == "header missing":
			require.False(t, present, "case %q", c.name)
		case fromMetadata:
			require.True(t, present, "case %q keeps its key header", c.name)
			require.True(t, raw == c.key, "case %q: key header changed to %q", c.name, raw)
		default:
			uuid, _ := p.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
			require.True(t, uuid == c.key, "case %q: UUID changed to %q", c.name, uuid)
		}
	}
	rejected := e.Log.Events()
	n := 0
	for _, ev := range rejected {
		if ev.Outcome == exactlyonce.Nacked && errors.Is(ev.Err, exactlyonce.ErrInvalidKey) {
			n++
			require.True(t, hostileIsKeyError(ev.Err), "rejection error: %v", ev.Err)
		}
	}
	require.Equal(t, len(cases), n, "one rejection per hostile message")
	require.Equal(t, int64(1), e.Log.Processed.Load())
	require.Equal(t, int64(1), e.Log.Duplicates.Load())
	require.Zero(t, e.Log.Failed.Load()+e.Log.ClaimFailed.Load())
	require.Zero(t, e.Log.DBUnavailable.Load())
	require.Equal(t, []string{goodKey}, e.handledKeys(), "the handler ran for the good message only")
	require.Equal(t, int64(1), e.Effects.Count(t, ""))
	require.Equal(t, int64(1), e.inboxRows(t), "no inbox row for a rejected key")
}

// Without a poison queue (against the docs' advice) a message whose key is
// rejected is nacked and requeued by watermill-amqp at the head of the
// queue, again and again (here without delay: NackDelay, which paces these
// nacks, is disabled to show the loop quickly). This test records what that means for the
// messages behind it on a prefetch-1 consumer: it is not lost, and the good
// message behind it is blocked as long as the router runs.
func TestRejectedKeyWithoutPoisonQueueIsRequeued(t *testing.T) {
	t.Parallel()
	e := hostileSetup(t, testenv.DriverNamed(t, "pgxpool"))
	eo := e.middleware(t, false, nil)
	r := e.startRouter(t, "hostile-no-poison", eo, nil, nil, e.handler(nil))

	bad := message.NewMessage("", []byte(`{"case":"empty key"}`))
	require.NoError(t, e.Pub.Publish(e.In, bad))
	good := message.NewMessage("good-"+watermill.NewUUID(), []byte(`{"case":"good"}`))
	require.NoError(t, e.Pub.Publish(e.In, good))

	// 50 rejections: the keyless message came back at least 49 times.
	testenv.Eventually(t, waitTimeout, func() bool { return e.Log.Rejected.Load() >= 50 },
		"the keyless message was not redelivered in a loop")
	processedDuringLoop := e.Log.Processed.Load()
	require.NoError(t, r.Close())
	requireQueueSettled(t, e.Conn, e.In, 2-int(processedDuringLoop))

	t.Logf("after %d rejections of the keyless message: good message processed %d time(s)",
		e.Log.Rejected.Load(), processedDuringLoop)
	require.Zero(t, processedDuringLoop,
		"observed behaviour changed: the good message behind a looping rejected one was processed (update this test and docs)")
	require.Empty(t, e.handledKeys())
}

// ---------------------------------------------------------------------------
// Keys with SQL metacharacters are data.

// hostileSQLKeys are valid keys that would break naive quoting: the pgx
// fast path (inboxdb.Store.BeginClaimPgx) sends the key as a quoted literal in
// a multi-statement query. schema is the test schema, for injections that
// name its canary table.
func hostileSQLKeys(schema string) []string {
	canary := `"` + schema + `".canary`
	keys := []string{
		`'`, `''`, `'''`, `\`, `\\`, `\'`, `'\`, `\''`, `''\`,
		`'; DROP TABLE x; --`,
		`'); DROP TABLE ` + canary + `; --`,
		`', 'k'); DROP TABLE ` + canary + `; --`,
		`'); COMMIT; DROP TABLE ` + canary + `; BEGIN; SELECT ('`,
		`\'); DROP TABLE ` + canary + `; --`,
		`E'\x41'`, `E'\''`, `e'\\\''`, `E'\'); DROP TABLE ` + canary + `; --`,
		`$$`, `$$'$$`, `$$; DROP TABLE ` + canary + `; $$`, `$tag$'$tag$`, `$1`, `$2::text`,
		`U&'\0041'`, `U&"\0041"`, `\u0000`, `\x00`, `\0`,
		`"`, `""`, `"; --`, `/*`, `*/`, `--`, `;`, `%s%d%v%%`, `?`, `:name`, `@p1`,
		"ключ-🔑", "键", "😀'😀", "\u02bc\u2019\uff07", // lookalike quotes
		"é", "e\u0301", // NFC and NFD: different keys
		"Key", "key", "KEY", "k", "k ", " k", // byte-wise identity
		"\t\r\n", "\x1b[31mred", "\u2028\u2029", "\ufeffbom", "\u202eevil", "\x7f",
		strings.Repeat("'", 1024), // the limit, doubled by quoting
		strings.Repeat(`\`, 1024), // the limit
		strings.Repeat("😀", 256),  // 1024 bytes of 4-byte runes
	}
	return keys
}

// Keys with SQL metacharacters (quotes, backslashes, E” and dollar quotes,
// injections naming a real table, lookalike unicode, control characters,
// 1 KB of quotes) are stored byte for byte and deduplicated like any other
// key, under a consumer name that is hostile too: both drivers (the pgx pool
// takes the one-round-trip path that quotes the key as a literal), both
// modes. Each key is published twice: the handler runs once, the second copy
// is a duplicate, the inbox holds exactly the key, and the canary table the
// injections aim at is still there.
func TestSQLMetacharacterKeysAreStoredVerbatim(t *testing.T) {
	t.Parallel()
	hostileEachDriverMode(t, func(t *testing.T, d testenv.Driver, lease bool) {
		e := hostileSetup(t, d)
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		_, err := d.DB.ExecContext(ctx, `CREATE TABLE `+pgx.Identifier{e.DB.Schema, "canary"}.Sanitize()+` (id int)`)
		require.NoError(t, err)
		tablesBefore := e.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, e.DB.Schema)

		consumer := `it's a "hostile" \ $$ consumer'; DROP TABLE x; --`
		eo := e.middleware(t, lease, nil)
		r := e.startRouter(t, consumer, eo, hostilePoisonFilter, nil, e.handler(nil))

		keys := hostileSQLKeys(e.DB.Schema)
		seen := map[string]bool{}
		for _, k := range keys {
			require.False(t, seen[k], "duplicate key in the list: %q", k)
			seen[k] = true
			publishCopies(t, e.Pub, e.In, k, []byte(`{}`), 2)
		}
		waitSettled(t, e.Log, int64(2*len(keys)))
		require.NoError(t, r.Close())
		requireQueueSettled(t, e.Conn, e.In, 0)
		require.Empty(t, drainQueue(t, e.Conn, e.poison), "nothing poisoned")

		require.Equal(t, int64(len(keys)), e.Log.Processed.Load())
		require.Equal(t, int64(len(keys)), e.Log.Duplicates.Load())
		require.Zero(t, e.Log.Rejected.Load()+e.Log.Failed.Load()+e.Log.ClaimFailed.Load()+e.Log.DBUnavailable.Load())
		require.ElementsMatch(t, keys, e.handledKeys(), "the handler ran once per key and saw it byte for byte")
		for _, c := range e.handledConsumers {
			require.Equal(t, consumer, c)
		}
		for _, k := range keys {
			require.Equal(t, int64(1), e.Effects.Count(t, k), "effects of %q", k)
			rec := inboxRecord(t, e.DB, consumer, k)
			require.Equal(t, k, rec.Key)
			require.Equal(t, consumer, rec.Consumer)
			require.Equal(t, inboxdb.StatusDone, rec.Status, "key %q", k)
			require.Equal(t, int64(1), rec.Duplicates, "key %q", k)
		}
		require.Equal(t, int64(len(keys)), e.inboxRows(t))
		require.Equal(t, tablesBefore, e.Count(t, `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, e.DB.Schema),
			"no table of the test schema was dropped")
		require.Zero(t, e.Count(t, `SELECT count(*) FROM `+pgx.Identifier{e.DB.Schema, "canary"}.Sanitize()))
	})
}

// ---------------------------------------------------------------------------
// Payloads and output metadata through the middleware and the outbox.

// hostilePayloads are input payloads the handler echoes into its output.
func hostilePayloads() []struct {
	name    string
	payload []byte
} {
	all := make([]byte, 0, 512)
	for range 2 {
		for b := range 256 {
			all = append(all, byte(b))
		}
	}
	huge := make([]byte, 8<<20)
	_, _ = rand.Read(huge)
	return []struct {
		name    string
		payload []byte
	}{
		{"malformed JSON", []byte(`{"sms": "unterminated`)},
		{"not JSON", []byte(`<xml>no json here</xml> ' " \ $$`)},
		{"empty", []byte{}},
		{"binary with NUL", all},
		{"invalid UTF-8", []byte("text \xff\xfe\xfd then \xc3 and \xed\xa0\x80 (a surrogate)")},
		{"only NUL", []byte{0, 0, 0}},
		{"8 MB", huge},
	}
}

// hostileOutputMetadata are odd metadata values a handler may put on its
// output messages; they must round-trip through the outbox (jsonb) and
// AMQP headers.
func hostileOutputMetadata() message.Metadata {
	return message.Metadata{
		"unicode":                "ключ 🔑 é e\u0301 \u202eevil \u2028",
		"quotes":                 `it's "quoted" \ back\slash '' \' $$ $tag$`,
		"json-text":              `{"a": [1, 2], "b": "\u0000", "c": null}`,
		"newlines":               "line1\nline2\r\nline3\ttab",
		"long":                   strings.Repeat("long value ", 3000), // 33 KB
		"empty":                  "",
		"ключ":                   "unicode key",
		`k"'\`:                   "quote key",
		strings.Repeat("m", 255): "longest AMQP header name",
	}
}

// Malformed, non-JSON, empty, binary (with NUL bytes), invalid UTF-8 and an
// 8 MB payload go through the middleware and the outbox (a bytea column),
// and the relay publishes each to the output queue byte for byte, with
// metadata of odd values (unicode, quotes, newlines, JSON-looking text,
// a 33 KB value, a 255-byte name) intact. A good message behind them is
// processed too. Both drivers, both modes.
func TestOddPayloadsAreRelayedIntact(t *testing.T) {
	t.Parallel()
	payloads := hostilePayloads()
	hostileEachDriverMode(t, func(t *testing.T, d testenv.Driver, lease bool) {
		e := hostileSetup(t, d)
		eo := e.middleware(t, lease, nil)
		r := e.startRouter(t, "hostile-payloads", eo, hostilePoisonFilter, nil, e.handler(func(msg *message.Message) []*message.Message {
			out := message.NewMessage(msg.UUID+"-echo", msg.Payload)
			out.Metadata = hostileOutputMetadata()
			return []*message.Message{out}
		}))

		uuids := make([]string, len(payloads))
		for i, p := range payloads {
			uuids[i] = "payload-" + watermill.NewUUID()
			msg := message.NewMessage(uuids[i], p.payload)
			msg.Metadata.Set(hostileCaseHeader, p.name)
			require.NoError(t, e.Pub.Publish(e.In, msg))
		}
		good := "good-" + watermill.NewUUID()
		require.NoError(t, e.Pub.Publish(e.In, message.NewMessage(good, []byte(`{"ok":true}`))))

		waitSettled(t, e.Log, int64(len(payloads)+1))
		require.NoError(t, r.Close())
		requireQueueSettled(t, e.Conn, e.In, 0)
		require.Equal(t, int64(len(payloads)+1), e.Log.Processed.Load())
		require.Zero(t, e.Log.Failed.Load()+e.Log.ClaimFailed.Load())

		collector := collect(t, e.Out)
		require.Equal(t, len(payloads)+1, relayOutbox(t, e.DB), "relayed messages")
		testenv.Eventually(t, waitTimeout, func() bool { return collector.Count() >= len(payloads)+1 },
			"outputs did not arrive")
		collector.Stop(t)
		require.Equal(t, len(payloads)+1, collector.Count(), "one output per input")
		wantMeta := hostileOutputMetadata()
		for i, p := range payloads {
			got := collector.Get(uuids[i] + "-echo")
			require.Len(t, got, 1, "output of %q", p.name)
			require.Equal(t, len(p.payload), len(got[0].Payload), "payload length of %q", p.name)
			require.True(t, string(p.payload) == string(got[0].Payload), "payload of %q is not byte-equal", p.name)
			require.Equal(t, wantMeta, got[0].Metadata, "metadata of %q", p.name)
		}
		require.Len(t, collector.Get(good+"-echo"), 1)
		requireQueueDrained(t, e.Out)
	})
}

// Output metadata that PostgreSQL's jsonb cannot hold: an invalid UTF-8
// value (a handler copying a header of a hostile producer) and a NUL byte.
// The outbox must relay each intact or refuse it with a clear error (the
// input then goes to the poison queue with the reason) — never change it
// silently; the good message behind them is processed either way.
func TestOutputMetadataNotJSONText(t *testing.T) {
	t.Parallel()
	for _, dn := range testenv.DriverNames {
		t.Run(dn, func(t *testing.T) {
			t.Parallel()
			d := testenv.DriverNamed(t, dn)
			e := hostileSetup(t, d)
			eo := e.middleware(t, false, nil)
			// An unfiltered poison queue: any handler error is dead-lettered.
			r := e.startRouter(t, "hostile-metadata", eo, func(error) bool { return true }, nil,
				e.handler(func(msg *message.Message) []*message.Message {
					out := message.NewMessage(msg.UUID+"-echo", msg.Payload)
					out.Metadata.Set("x-trace", msg.Metadata.Get("x-trace"))
					return []*message.Message{out}
				}))

			cases := []struct{ name, value string }{
				{"invalid UTF-8", "trace-\xff\xfe"},
				{"NUL", "trace\x00nul"},
			}
			for _, c := range cases {
				msg := message.NewMessage(c.name, []byte(`{}`))
				msg.Metadata.Set(hostileCaseHeader, c.name)
				msg.Metadata.Set("x-trace", c.value)
				require.NoError(t, e.Pub.Publish(e.In, msg))
			}
			good := "good-" + watermill.NewUUID()
			require.NoError(t, e.Pub.Publish(e.In, message.NewMessage(good, []byte(`{}`))))

			testenv.Eventually(t, waitTimeout, func() bool {
				return e.Log.Processed.Load()+e.Log.Failed.Load() >= int64(len(cases)+1) && e.Log.Processed.Load() >= 1
			}, "the messages were not handled")
			require.NoError(t, r.Close())
			requireQueueSettled(t, e.Conn, e.In, 0)
			poisoned := map[string]amqp.Delivery{}
			for _, p := range drainQueue(t, e.Conn, e.poison) {
				name, _ := p.Headers[hostileCaseHeader].(string)
				poisoned[name] = p
			}

			collector := collect(t, e.Out)
			relayed := relayOutbox(t, e.DB)
			testenv.Eventually(t, waitTimeout, func() bool { return collector.Count() >= relayed }, "outputs did not arrive")
			collector.Stop(t)
			require.Len(t, collector.Get(good+"-echo"), 1, "the good message behind is processed and relayed")

			var problems []string
			for _, c := range cases {
				out := collector.Get(c.name + "-echo")
				p, isPoisoned := poisoned[c.name]
				switch {
				case isPoisoned:
					require.Empty(t, out, "case %q: poisoned and relayed", c.name)
					reason, _ := p.Headers[wmiddleware.ReasonForPoisonedKey].(string)
					require.Contains(t, reason, "outbox", "case %q: the reason says what failed: %s", c.name, reason)
					t.Logf("case %q refused with a reason: %s", c.name, reason)
				case len(out) == 1 && out[0].Metadata.Get("x-trace") == c.value:
					t.Logf("case %q relayed intact", c.name)
				case len(out) == 1:
					problems = append(problems, fmt.Sprintf("case %q: output metadata silently changed from %q to %q",
						c.name, c.value, out[0].Metadata.Get("x-trace")))
				default:
					problems = append(problems, fmt.Sprintf("case %q: neither relayed nor poisoned (lost)", c.name))
				}
			}
			require.Empty(t, problems)
		})
	}
}

// hostileShortstrPublisher refuses, as the AMQP client would, a message
// with a header name over 255 bytes, before it reaches the client (with
// permanent, marked as the message's own: exactlyonce.Permanent): with
// watermill-amqp v3.1.0 the client's own refusal tears the connection down,
// and the publisher's reconnect logic then has a data race
// (ConnectionWrapper.handleConnectionClose writes the connected flag that
// IsConnected reads without synchronisation), which -race reports.
type hostileShortstrPublisher struct {
	message.Publisher
	permanent bool
}

func (p hostileShortstrPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		for k := range m.Metadata {
			if len(k) > 255 {
				err := fmt.Errorf("amqp: shortstr %q... exceeds 255 bytes", k[:16])
				if p.permanent {
					err = exactlyonce.Permanent(err)
				}
				return err
			}
		}
	}
	return p.Publisher.Publish(topic, msgs...)
}

// TestUnpublishableOutboxRowDoesNotBlock: an output message the broker can never
// take (a header name over AMQP's 255 bytes) does not block the rows behind
// it: they are relayed to RabbitMQ while it waits out its backoff. When the
// publisher says the failure is the message's own (as rabbitmq.Publisher
// does, and as a wrapper that checks what AMQP cannot carry can), it is
// quarantined after MaxAttempts failures and reported; when nothing says so,
// it is retried and reported as failing, never quarantined.
func TestUnpublishableOutboxRowDoesNotBlock(t *testing.T) {
	t.Parallel()
	d := testenv.DriverNamed(t, "pgxpool")
	e := hostileSetup(t, d)
	eo := e.middleware(t, false, nil)
	r := e.startRouter(t, "hostile-unpublishable", eo, hostilePoisonFilter, nil, e.handler(func(msg *message.Message) []*message.Message {
		out := message.NewMessage(msg.UUID+"-echo", msg.Payload)
		if msg.Metadata.Get(hostileCaseHeader) == "bad" {
			out.Metadata.Set(strings.Repeat("h", 256), "header name too long for AMQP")
		}
		return []*message.Message{out}
	}))
	bad := message.NewMessage("bad-"+watermill.NewUUID(), []byte(`{}`))
	bad.Metadata.Set(hostileCaseHeader, "bad")
	require.NoError(t, e.Pub.Publish(e.In, bad))
	good := "good-" + watermill.NewUUID()
	require.NoError(t, e.Pub.Publish(e.In, message.NewMessage(good, []byte(`{}`))))
	waitSettled(t, e.Log, 2)
	require.NoError(t, r.Close())

	collector := collect(t, e.Out)
	const maxAttempts = 2
	cfg := outbox.RelayConfig{
		DB: e.DB, Publisher: hostileShortstrPublisher{Publisher: testenv.AMQPPublisher(t)}, MaxAttempts: maxAttempts,
		ErrorBackoff: time.Millisecond, MaxErrorBackoff: time.Millisecond,
	}
	relay := newRelay(t, cfg)
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	n, err := relay.Flush(ctx)
	require.Error(t, err, "the unpublishable row is reported")
	require.Contains(t, err.Error(), "255", "the error says why: %v", err)
	require.Equal(t, 1, n, "the good row behind it was relayed")
	testenv.Eventually(t, 5*time.Second, func() bool { return len(collector.Get(good+"-echo")) == 1 },
		"the good message written after the unpublishable row was not relayed")

	// Nothing says the failure is the message's own: failing, not quarantined.
	for range 3 {
		time.Sleep(5 * time.Millisecond)
		_, err = relay.Flush(ctx)
		require.Error(t, err)
	}
	p, err := testenv.OutboxStore(t, e.DB).Pending(ctx)
	require.NoError(t, err)
	require.Equal(t, outbox.Pending{Count: 1, OldestCreatedAt: p.OldestCreatedAt, OldestAge: p.OldestAge, Failing: 1}, p,
		"failing, retried with backoff, not quarantined")

	// The wrapper marks what AMQP cannot carry as permanent: MaxAttempts
	// such failures quarantine it, while good rows behind it flow.
	cfg.Publisher = hostileShortstrPublisher{Publisher: testenv.AMQPPublisher(t), permanent: true}
	relay = newRelay(t, cfg)
	ob, err := outbox.NewWriter(e.DB)
	require.NoError(t, err)
	direct, err := ob.Publisher(d.DB)
	require.NoError(t, err)
	var goods []string
	for i := 0; p.Quarantined == 0; i++ {
		require.Less(t, i, maxAttempts, "not quarantined after %d permanent failures", i)
		goods = append(goods, "good-"+watermill.NewUUID())
		require.NoError(t, direct.Publish(e.Out, message.NewMessage(goods[i], []byte(`{}`))))
		time.Sleep(5 * time.Millisecond) // its backoff is over
		n, err := relay.Flush(ctx)
		require.Error(t, err)
		require.Equal(t, 1, n, "the good row behind it is relayed")
		p, err = testenv.OutboxStore(t, e.DB).Pending(ctx)
		require.NoError(t, err)
	}
	n, err = relay.Flush(ctx)
	require.NoError(t, err, "quarantined rows are skipped")
	require.Zero(t, n)
	require.Equal(t, outbox.Pending{Count: 1, Quarantined: 1}, p, "the quarantined row is reported")
	require.Equal(t, int64(1), relay.Stats().Quarantined)
	testenv.Eventually(t, 5*time.Second, func() bool { return collector.Count() == 1+len(goods) },
		"the good messages written behind the unpublishable row were not all relayed")
	collector.Stop(t)
	for _, g := range goods {
		require.Len(t, collector.Get(g), 1)
	}
}

// ---------------------------------------------------------------------------
// AMQP headers that are not strings.

// hostileCountingMarshaler is watermill-amqp's DefaultMarshaler, counting
// the deliveries it fails to unmarshal.
type hostileCountingMarshaler struct {
	wamqp.DefaultMarshaler
	failures *atomic.Int64
	lastErr  *atomic.Value
}

func (m hostileCountingMarshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	msg, err := m.DefaultMarshaler.Unmarshal(d)
	if err != nil {
		m.failures.Add(1)
		m.lastErr.Store(err.Error())
	}
	return msg, err
}

// hostileDeadLetter publishes a Watermill message through a queue whose
// messages expire at once into queue: RabbitMQ dead-letters it and adds its
// x-death header (an array of tables) and x-first-death-* headers.
func hostileDeadLetter(t testing.TB, conn *amqp.Connection, queue string, msg amqp.Publishing) {
	t.Helper()
	src := testenv.Unique(t, "hdlx_")
	ch, err := conn.Channel()
	require.NoError(t, err)
	defer func() { _ = ch.Close() }()
	_, err = ch.QueueDeclare(src, true, false, false, false, amqp.Table{
		"x-message-ttl":             int32(0),
		"x-dead-letter-exchange":    "",
		"x-dead-letter-routing-key": queue,
	})
	require.NoError(t, err)
	t.Cleanup(func() {
		c, err := amqp.Dial(testenv.AMQPURL())
		if err != nil {
			return
		}
		defer func() { _ = c.Close() }()
		if ch, err := c.Channel(); err == nil {
			_, _ = ch.QueueDelete(src, false, false, false)
		}
	})
	before, _ := queueState(t, conn, queue)
	publishRaw(t, conn, src, msg)
	testenv.Eventually(t, waitTimeout, func() bool {
		n, _ := queueState(t, conn, queue)
		return n == before+1
	}, "the message was not dead-lettered into %s", queue)
}

// Header values that are not strings — RabbitMQ's x-death after a real
// dead-lettering (an array of tables), numbers, a nested table — with
// watermill-amqp's DefaultMarshaler, as testenv and most users configure it.
// Observed and asserted here: Unmarshal fails, so the message never reaches
// the router (neither the middleware nor a poison queue can see it, so it
// cannot be dead-lettered with a reason); the subscriber nacks it with
// requeue, RabbitMQ puts it back at the head of the queue, and the loop runs
// without pause for as long as the router does. It is not lost (it is still
// in the queue when the router stops), but with prefetch 1 it blocks the
// good message behind it. rabbitmq.Marshaler handles these
// headers (examples/notifier/fuzz_test.go), as does a PreprocessDelivery
// that turns them into strings.
func TestNonStringHeadersWithDefaultMarshaler(t *testing.T) {
	t.Parallel()
	e := hostileSetup(t, testenv.DriverNamed(t, "pgxpool"))
	uuidKey := wamqp.DefaultMessageUUIDHeaderKey

	hostileDeadLetter(t, e.Conn, e.In, amqp.Publishing{
		Headers: amqp.Table{uuidKey: "dead-" + watermill.NewUUID(), hostileCaseHeader: "x-death"},
		Body:    []byte(`{"case":"x-death"}`),
	})
	publishRaw(t, e.Conn, e.In, amqp.Publishing{
		Headers: amqp.Table{uuidKey: "num-" + watermill.NewUUID(), hostileCaseHeader: "number", "retries": int32(3), "ratio": 0.5},
		Body:    []byte(`{"case":"number"}`),
	})
	publishRaw(t, e.Conn, e.In, amqp.Publishing{
		Headers: amqp.Table{uuidKey: "nested-" + watermill.NewUUID(), hostileCaseHeader: "nested",
			"meta": amqp.Table{"a": amqp.Table{"b": int64(1)}, "list": []any{"x", int16(2)}}},
		Body: []byte(`{"case":"nested"}`),
	})
	good := "good-" + watermill.NewUUID()
	require.NoError(t, e.Pub.Publish(e.In, message.NewMessage(good, []byte(`{"case":"good"}`))))
	n, _ := queueState(t, e.Conn, e.In)
	require.Equal(t, 4, n)

	var failures atomic.Int64
	var lastErr atomic.Value
	cfg := wamqp.NewDurableQueueConfig(testenv.AMQPURL())
	cfg.Consume.Qos.PrefetchCount = 1
	cfg.Marshaler = hostileCountingMarshaler{failures: &failures, lastErr: &lastErr}
	sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })

	var deliveries deliveryLog
	eo := e.middleware(t, false, nil)
	r := newRouter(t)
	pq, err := wmiddleware.PoisonQueue(e.Pub, e.poison)
	require.NoError(t, err)
	r.AddMiddleware(deliveries.Middleware, pq, eo.Middleware)
	r.AddHandler("hostile-headers", e.In, sub, e.Out, outboxOnly(t), e.handler(nil))
	testenv.StartRouter(t, r)

	testenv.Eventually(t, waitTimeout, func() bool { return failures.Load() >= 50 },
		"the subscriber did not keep failing on the non-string headers")
	processed := e.Log.Processed.Load()
	require.NoError(t, r.Close())
	require.NoError(t, sub.Close())
	t.Logf("DefaultMarshaler: %d failed unmarshals (last: %v); deliveries reaching the router: %d; good processed: %d",
		failures.Load(), lastErr.Load(), deliveries.Total(), processed)

	require.Contains(t, lastErr.Load(), "is not a string")
	require.Zero(t, deliveries.Total(), "no hostile delivery reached the router")
	require.Zero(t, processed, "observed behaviour changed: the good message behind was processed (update this test and docs)")
	require.Empty(t, drainQueue(t, e.Conn, e.poison), "nothing can be dead-lettered: the router never saw the message")
	requireQueueSettled(t, e.Conn, e.In, 4)
	byCase := map[string]amqp.Delivery{}
	for _, d := range drainQueue(t, e.Conn, e.In) {
		name, _ := d.Headers[hostileCaseHeader].(string)
		byCase[name] = d
	}
	require.Len(t, byCase, 4, "nothing lost")
	xdeath, ok := byCase["x-death"].Headers["x-death"].([]any)
	require.True(t, ok, "RabbitMQ added x-death as an array: %#v", byCase["x-death"].Headers["x-death"])
	require.NotEmpty(t, xdeath)
	_, ok = xdeath[0].(amqp.Table)
	require.True(t, ok, "x-death holds tables")
	require.Equal(t, int64(0), e.inboxRows(t))

	// Proof that the headers, not the message, are the problem: the same
	// router with the documented PreprocessDelivery workaround (drop or
	// stringify the non-string headers) processes all of them.
	cfg.Marshaler = wamqp.DefaultMarshaler{PreprocessDelivery: hostileStringifyHeaders}
	sub2, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub2.Close() })
	for _, d := range byCase {
		publishRaw(t, e.Conn, e.In, amqp.Publishing{Headers: d.Headers, Body: d.Body})
	}
	e.startRouter(t, "hostile-headers-fixed", eo, nil, sub2, e.handler(nil))
	waitSettled(t, e.Log, 4)
	require.Equal(t, int64(4), e.inboxRows(t))
}

// hostileStringifyHeaders is a PreprocessDelivery that turns every
// non-string header value into text.
func hostileStringifyHeaders(d amqp.Delivery) amqp.Delivery {
	h := make(amqp.Table, len(d.Headers))
	for k, v := range d.Headers {
		if s, ok := v.(string); ok {
			h[k] = s
			continue
		}
		b, err := json.Marshal(v)
		if err != nil {
			b = []byte(fmt.Sprint(v))
		}
		h[k] = string(b)
	}
	d.Headers = h
	return d
}

// ---------------------------------------------------------------------------
// SQL injection through configuration.

// hostileNoDB fails the test on any use: configuration must be rejected
// before the database is touched.
type hostileNoDB struct{ t testing.TB }

var errHostileNoDB = errors.New("hostileNoDB: the database must not be touched")

func (d hostileNoDB) BeginTx(context.Context, *stdsql.TxOptions) (wsql.Tx, error) {
	d.t.Errorf("BeginTx called with a hostile configuration")
	return nil, errHostileNoDB
}

func (d hostileNoDB) ExecContext(context.Context, string, ...any) (wsql.Result, error) {
	d.t.Errorf("ExecContext called with a hostile configuration")
	return nil, errHostileNoDB
}

func (d hostileNoDB) QueryContext(context.Context, string, ...any) (wsql.Rows, error) {
	d.t.Errorf("QueryContext called with a hostile configuration")
	return nil, errHostileNoDB
}

// hostileNamePublisher is a Publisher for RelayConfig that must never be
// used.
type hostileNamePublisher struct{ t testing.TB }

func (p hostileNamePublisher) Publish(string, ...*message.Message) error {
	p.t.Errorf("Publish called with a hostile configuration")
	return errHostileNoDB
}
func (hostileNamePublisher) Close() error { return nil }

// Schema and table names that try SQL injection (and names PostgreSQL would
// mangle) through every function that takes them — sqlschema.DB (Validate,
// SQL, Migrate, Check), inbox.NewStore (and the internal inboxdb.NewStore),
// exactlyonce.New (both modes), outbox.NewRelay, outbox.NewWriter,
// outbox.NewStore — are rejected as an "invalid
// SQL identifier" naming the field, before the database is touched; Migrate against the real database creates nothing (checked in
// pg_namespace and pg_class for the marker every injection would create).
func TestSQLInjectionInConfigNamesIsRejected(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t)
	real := wsql.BeginnerFromPgx(pool)
	marker := testenv.Unique(t, "hinj_")
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
		defer cancel()
		_, _ = pool.Exec(ctx, `DROP SCHEMA IF EXISTS `+pgx.Identifier{marker}.Sanitize()+` CASCADE`)
		_, _ = pool.Exec(ctx, `DROP TABLE IF EXISTS `+pgx.Identifier{"public", marker}.Sanitize())
	})
	injections := []string{
		`x"; CREATE SCHEMA "` + marker + `"; --`,
		`x"(id int); CREATE TABLE public."` + marker + `"(id int); --`,
		`x'; CREATE SCHEMA ` + marker + `; --`,
		`x; CREATE SCHEMA ` + marker,
		`public"."` + marker,
		marker + `" CASCADE; --`,
		`$$; CREATE SCHEMA ` + marker + `; $$`,
		`\"; CREATE SCHEMA ` + marker + `; --`,
		marker + "\x00",
		marker + "\n",
		" " + marker,
		marker + "ü",
		strings.Repeat("a", 41),
	}
	ctx, cancel := context.WithTimeout(context.Background(), waitTimeout)
	defer cancel()
	for _, field := range []string{"Schema", "InboxTable", "OutboxTable"} {
		for _, name := range injections {
			cfg := sqlschema.DB{}
			switch field {
			case "Schema":
				cfg.Schema = name
			case "InboxTable":
				cfg.InboxTable = name
			case "OutboxTable":
				cfg.OutboxTable = name
			}
			what := field + "=" + name
			requireInvalid := func(err error, where string) {
				t.Helper()
				require.ErrorContains(t, err, "invalid SQL identifier", "%s: %s", where, what)
				require.Contains(t, err.Error(), field, "%s: the error names the field: %s", where, what)
			}
			noDB := testenv.WithConn(cfg, hostileNoDB{t})
			requireInvalid(cfg.Validate(), "Validate")
			_, err := sqlschema.SQL(cfg)
			requireInvalid(err, "SQL")
			requireInvalid(sqlschema.Migrate(ctx, noDB), "Migrate")
			requireInvalid(sqlschema.Migrate(ctx, testenv.WithConn(cfg, real)), "Migrate (real database)")
			requireInvalid(sqlschema.Check(ctx, noDB), "Check")
			_, err = inbox.NewStore(noDB)
			requireInvalid(err, "inbox.NewStore")
			_, err = inboxdb.NewStore(inboxdb.Config{Tables: cfg})
			requireInvalid(err, "inboxdb.NewStore")
			_, err = exactlyonce.New(exactlyonce.Config{DB: noDB})
			requireInvalid(err, "exactlyonce.New")
			_, err = exactlyonce.New(exactlyonce.Config{DB: noDB, Lease: &exactlyonce.LeaseConfig{}})
			requireInvalid(err, "exactlyonce.New (lease)")
			_, err = outbox.NewRelay(outbox.RelayConfig{DB: noDB, Publisher: hostileNamePublisher{t}})
			requireInvalid(err, "outbox.NewRelay")
			_, err = outbox.NewWriter(noDB)
			requireInvalid(err, "outbox.NewWriter")
			_, err = outbox.NewStore(noDB)
			requireInvalid(err, "outbox.NewStore")
		}
	}
	require.Zero(t, testenv.Count(t, real, `SELECT count(*) FROM pg_namespace WHERE strpos(nspname, $1) > 0`, marker),
		"a schema was created by an injection")
	require.Zero(t, testenv.Count(t, real, `SELECT count(*) FROM pg_class WHERE strpos(relname, $1) > 0`, marker),
		"a table was created by an injection")
}

// ---------------------------------------------------------------------------
// Lease mode: handler errors whose text comes from hostile input.

// A lease-mode handler whose error text quotes hostile input (invalid
// UTF-8, NUL bytes, 1 MB of it) — a permanent error and a transient one —
// has its failure recorded as readable, bounded text: the permanent one is
// parked and acked, the transient one runs again and succeeds, and the good
// message behind both is processed. Both drivers.
func TestLeaseErrorTextFromUntrustedInput(t *testing.T) {
	t.Parallel()
	for _, dn := range testenv.DriverNames {
		t.Run(dn, func(t *testing.T) {
			t.Parallel()
			d := testenv.DriverNamed(t, dn)
			e := hostileSetup(t, d)
			eo := e.middleware(t, true, nil)
			hostileText := "bad input \xff\xfe \x00 NUL " + strings.Repeat("\x00é\xc3", 1<<18)
			var transientRuns atomic.Int64
			const consumer = "hostile-lease-errors"
			r := e.startRouter(t, consumer, eo, nil, nil, func(msg *message.Message) ([]*message.Message, error) {
				switch msg.Metadata.Get(hostileCaseHeader) {
				case "permanent":
					return nil, exactlyonce.Permanent(errors.New("rejected: " + hostileText))
				case "transient":
					if transientRuns.Add(1) == 1 {
						return nil, errors.New("provider said: " + hostileText)
					}
				}
				return e.handler(nil)(msg)
			})
			uuids := map[string]string{}
			for _, name := range []string{"permanent", "transient", "good"} {
				uuids[name] = name + "-" + watermill.NewUUID()
				msg := message.NewMessage(uuids[name], []byte(`{}`))
				msg.Metadata.Set(hostileCaseHeader, name)
				require.NoError(t, e.Pub.Publish(e.In, msg))
			}
			testenv.Eventually(t, waitTimeout, func() bool {
				return e.Log.Parked.Load() == 1 && e.Log.Processed.Load() == 2
			}, "expected 1 parked and 2 processed")
			require.NoError(t, r.Close())
			requireQueueSettled(t, e.Conn, e.In, 0)
			require.Equal(t, int64(2), transientRuns.Load())

			parked := inboxRecord(t, e.DB, consumer, uuids["permanent"])
			require.Equal(t, inboxdb.StatusParked, parked.Status)
			require.True(t, utf8.ValidString(parked.LastError), "last_error is text")
			require.NotContains(t, parked.LastError, "\x00")
			require.Contains(t, parked.LastError, "rejected: bad input")
			require.LessOrEqual(t, len(parked.LastError), 4096, "last_error is bounded")
			done := inboxRecord(t, e.DB, consumer, uuids["transient"])
			require.Equal(t, inboxdb.StatusDone, done.Status)
			require.Equal(t, 2, done.Attempts)
			require.Equal(t, inboxdb.StatusDone, inboxRecord(t, e.DB, consumer, uuids["good"]).Status)
			require.Equal(t, int64(2), e.Effects.Count(t, ""))
		})
	}
}
