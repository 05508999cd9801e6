package console

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

const testToken = "console-test-token-0123456789"

// syncBuffer is a log destination the handler and the test share.
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

// lines returns the JSON log lines whose msg is msg.
func (s *syncBuffer) lines(t *testing.T, msg string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(s.String()), "\n") {
		if line == "" {
			continue
		}
		var m map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &m), line)
		if s, _ := m["msg"].(string); s == msg {
			out = append(out, m)
		}
	}
	return out
}

// tenv is what a test of the console works with: a fresh schema, its
// stores, the handler (mounted at /eo, bearer token), its log.
type tenv struct {
	t     *testing.T
	ctx   context.Context
	db    sqlschema.DB
	inner *inboxdb.Store
	store *inbox.Store
	h     http.Handler
	cfg   Config
	logs  *syncBuffer
	// mysql: the schema is MySQL/MariaDB's (a test's own statements pick
	// that dialect's text with sql).
	mysql bool
}

// sql is pg or mysql: the text of a test's own statement in the env's
// dialect.
func (e *tenv) sql(pg, mysql string) string {
	if e.mysql {
		return mysql
	}
	return pg
}

// newEnv makes a tenv; mutate edits the Config before New.
func newEnv(t *testing.T, mutate ...func(*Config)) *tenv {
	t.Helper()
	return newEnvOn(t, testenv.Schema(t), mutate...)
}

// newEngineEnv makes a tenv on the bundle's schema, PostgreSQL or
// MySQL/MariaDB (the engine matrix: testenv.EachEngine).
func newEngineEnv(t *testing.T, b *testenv.Bundle, mutate ...func(*Config)) *tenv {
	t.Helper()
	return newEnvOn(t, b.DB, mutate...)
}

// newEnvOn makes a tenv on db.
func newEnvOn(t *testing.T, db sqlschema.DB, mutate ...func(*Config)) *tenv {
	t.Helper()
	db = db.WithDefaults()
	e := envWith(t, Config{DB: db}, mutate...)
	e.mysql = db.Dialect == sqlschema.MySQL
	inner, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	require.NoError(t, err)
	store, err := inbox.NewStore(db)
	require.NoError(t, err)
	e.db, e.inner, e.store = db, inner, store
	return e
}

// envWith makes a tenv with cfg (no schema of its own).
func envWith(t *testing.T, cfg Config, mutate ...func(*Config)) *tenv {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	logs := &syncBuffer{}
	cfg.Auth = BearerToken(testToken)
	cfg.Prefix = "/eo"
	cfg.Logger = slog.New(slog.NewJSONHandler(logs, nil))
	for _, m := range mutate {
		m(&cfg)
	}
	h, err := New(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { h.(*handler).stats.wait() })
	return &tenv{t: t, ctx: ctx, h: h, cfg: cfg, logs: logs}
}

// call sends a request to the handler: with the bearer token unless hdr
// says "Authorization" itself ("" for none), from 192.0.2.1:1234 unless
// hdr says "RemoteAddr"; body is JSON unless it is url.Values (a form) or
// a string.
func (e *tenv) call(method, path string, body any, hdr ...string) *httptest.ResponseRecorder {
	e.t.Helper()
	var rd io.Reader
	ct := ""
	switch b := body.(type) {
	case nil:
	case url.Values:
		rd, ct = strings.NewReader(b.Encode()), "application/x-www-form-urlencoded"
	case string:
		rd, ct = strings.NewReader(b), "application/json"
	default:
		js, err := json.Marshal(b)
		require.NoError(e.t, err)
		rd, ct = bytes.NewReader(js), "application/json"
	}
	r := httptest.NewRequest(method, "http://console.test"+path, rd)
	if ct != "" {
		r.Header.Set("Content-Type", ct)
	}
	r.Header.Set("Authorization", "Bearer "+testToken)
	for i := 0; i+1 < len(hdr); i += 2 {
		if hdr[i] == "RemoteAddr" { // not a header: the client's address
			r.RemoteAddr = hdr[i+1]
			continue
		}
		if hdr[i+1] == "" {
			r.Header.Del(hdr[i])
			continue
		}
		r.Header.Set(hdr[i], hdr[i+1])
	}
	w := httptest.NewRecorder()
	e.h.ServeHTTP(w, r)
	return w
}

func (e *tenv) get(path string, hdr ...string) *httptest.ResponseRecorder {
	e.t.Helper()
	return e.call(http.MethodGet, path, nil, hdr...)
}

// ok asserts status 200 and decodes the JSON body into a map.
func ok(t *testing.T, w *httptest.ResponseRecorder) map[string]any {
	t.Helper()
	require.Equal(t, http.StatusOK, w.Code, "%s", w.Body)
	var m map[string]any
	require.NoError(t, json.Unmarshal(w.Body.Bytes(), &m), w.Body.String())
	return m
}

// decode asserts status 200 and decodes the JSON body into v.
func decode(t *testing.T, w *httptest.ResponseRecorder, v any) {
	t.Helper()
	require.Equal(t, http.StatusOK, w.Code, "%s", w.Body)
	require.NoError(t, json.Unmarshal(w.Body.Bytes(), v), w.Body.String())
}

// apiErr asserts a JSON error with status and code, and returns it.
func apiErr(t *testing.T, w *httptest.ResponseRecorder, status int, code string) errorJSON {
	t.Helper()
	require.Equal(t, status, w.Code, "%s", w.Body)
	require.Equal(t, "application/json; charset=utf-8", w.Header().Get("Content-Type"), "%s", w.Body)
	var b errorBody
	require.NoError(t, json.Unmarshal(w.Body.Bytes(), &b), w.Body.String())
	require.Equal(t, code, b.Error.Code, "%s", w.Body)
	require.NotEmpty(t, b.Error.Message)
	return b.Error
}

// pmsg is a parked message to seed.
type pmsg struct {
	uuid, topic, reason string
	payload             []byte
	notKept             bool
	meta                map[string]string
}

// park parks (consumer, key) with m in the PostgreSQL inbox, as the
// middleware does.
func (e *tenv) park(consumer, key string, m pmsg) {
	e.t.Helper()
	if m.uuid == "" {
		m.uuid = "uuid-" + key
	}
	if m.reason == "" {
		m.reason = "permanent: invalid order"
	}
	pm := &inboxdb.ParkedMessage{UUID: m.uuid, Topic: m.topic, Payload: m.payload, PayloadSize: len(m.payload), Metadata: m.meta}
	if pm.Payload == nil && !m.notKept {
		pm.Payload = []byte{}
	}
	if m.notKept {
		pm.Payload, pm.PayloadSize = nil, 1<<20
	}
	require.NoError(e.t, e.inner.Park(e.ctx, e.db.Conn, consumer, key, m.reason, pm))
}

// done records (consumer, key) as processed, with dups duplicates.
func (e *tenv) done(consumer, key string, dups int) {
	e.t.Helper()
	_, err := e.db.Conn.ExecContext(e.ctx, e.sql(`INSERT INTO `+e.db.Inbox()+` (consumer, message_key, status, attempts, processed_at, duplicates)
VALUES ($1, $2, 'done', 1, now(), $3)`, `INSERT INTO `+e.db.Inbox()+` (consumer, message_key, status, attempts, first_seen_at, processed_at, duplicates)
VALUES (?, ?, 'done', 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), ?)`), consumer, key, dups)
	require.NoError(e.t, err)
}

// row writes an outbox row: quarantined, failing, or pending.
func (e *tenv) row(topic, uuid, payload string, meta map[string]string, state string) int64 {
	e.t.Helper()
	js, err := json.Marshal(meta)
	require.NoError(e.t, err)
	if meta == nil {
		js = []byte("{}")
	}
	failures, quarantined, lastError := 0, "NULL", ""
	switch state {
	case "quarantined":
		failures, quarantined, lastError = 5, "now() - interval '1 minute'", "PRECONDITION_FAILED - message too large"
	case "failing":
		failures, lastError = 2, "connection lost"
	}
	var id int64
	if e.mysql {
		if quarantined != "NULL" {
			quarantined = "UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE"
		}
		_, err := e.db.Conn.ExecContext(e.ctx, `INSERT INTO `+e.db.Outbox()+`
 (topic, uuid, payload, metadata, failures, attempts, last_error, quarantined_at, created_at)
 VALUES (?, ?, ?, ?, ?, ?, NULLIF(?, ''), `+quarantined+`, UTC_TIMESTAMP(6) - INTERVAL 10 SECOND)`,
			topic, uuid, []byte(payload), string(js), failures, failures, lastError)
		require.NoError(e.t, err)
		require.NoError(e.t, seam.QueryRow(e.ctx, e.db.Conn, `SELECT max(id) FROM `+e.db.Outbox()+` WHERE uuid = ?`, []any{uuid}, &id))
		return id
	}
	require.NoError(e.t, seam.QueryRow(e.ctx, e.db.Conn, `INSERT INTO `+e.db.Outbox()+`
 (topic, uuid, payload, metadata, failures, attempts, last_error, quarantined_at, created_at)
 VALUES ($1, $2, $3, $4::jsonb, $5, $5, nullif($6, ''), `+quarantined+`, now() - interval '10 seconds') RETURNING id`,
		[]any{topic, uuid, []byte(payload), string(js), failures, lastError}, &id))
	return id
}

// outboxRows counts the outbox's rows of topic with uuid.
func (e *tenv) outboxRows(topic, uuid string) int64 {
	e.t.Helper()
	return testenv.Count(e.t, e.db.Conn, `SELECT count(*) FROM `+e.db.Outbox()+e.sql(` WHERE topic = $1 AND uuid = $2`, ` WHERE topic = ? AND uuid = ?`), topic, uuid)
}

func (e *tenv) status(consumer, key string) string {
	e.t.Helper()
	r, err := e.store.Get(e.ctx, consumer, key)
	if err != nil {
		require.ErrorIs(e.t, err, inbox.ErrNotFound)
		return ""
	}
	return r.Status
}

// settle waits for the overview's figures to be computed.
func (e *tenv) settle() {
	e.t.Helper()
	e.h.(*handler).stats.get(e.ctx)
	e.h.(*handler).stats.wait()
}

// recorder is a publisher that keeps what it was given.
type recorder struct {
	mu   sync.Mutex
	msgs []published
	fail error
}

type published struct {
	topic string
	msg   *message.Message
}

func (p *recorder) Publish(topic string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fail != nil {
		return p.fail
	}
	for _, m := range msgs {
		p.msgs = append(p.msgs, published{topic, m})
	}
	return nil
}

func (p *recorder) Close() error { return nil }

func (p *recorder) all() []published {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]published(nil), p.msgs...)
}

// *redisstore.Store is what Config.Redis takes.
var _ RedisStore = (*redisstore.Store)(nil)

// redisEnv is a Redis store of the test's own prefix.
type redisEnv struct {
	c     *redis.Client
	store *redisstore.Store
}

func newRedis(t *testing.T) redisEnv {
	t.Helper()
	c := testenv.Redis(t)
	s, err := redisstore.New(redisstore.Config{Client: c, Prefix: testenv.RedisPrefix(t, c)})
	require.NoError(t, err)
	return redisEnv{c: c, store: s}
}

// park parks (consumer, key) in Redis with m, as the middleware does.
func (r redisEnv) park(t *testing.T, ctx context.Context, consumer, key string, m pmsg) {
	t.Helper()
	if m.uuid == "" {
		m.uuid = "uuid-" + key
	}
	if m.reason == "" {
		m.reason = "permanent: invalid order"
	}
	lb := leasestore.BackendOf(r.store)
	claim, err := lb.Claim(ctx, consumer, key, leasestore.Options{Lease: time.Minute})
	require.NoError(t, err)
	require.Equal(t, leasestore.Acquired, claim.Outcome)
	payload := m.payload
	if payload == nil {
		payload = []byte{}
	}
	msg := &inboxdb.ParkedMessage{UUID: m.uuid, Topic: m.topic, Payload: payload, PayloadSize: len(payload), Metadata: m.meta}
	require.NoError(t, lb.Fail(ctx, leasestore.Attempt{Consumer: consumer, Key: key, Token: claim.Token, Message: msg}, m.reason, true))
}

// done records (consumer, key) as done in Redis.
func (r redisEnv) done(t *testing.T, ctx context.Context, consumer, key string) {
	t.Helper()
	lb := leasestore.BackendOf(r.store)
	claim, err := lb.Claim(ctx, consumer, key, leasestore.Options{Lease: time.Minute})
	require.NoError(t, err)
	require.NoError(t, lb.Complete(ctx, leasestore.Attempt{Consumer: consumer, Key: key, Token: claim.Token}))
}
