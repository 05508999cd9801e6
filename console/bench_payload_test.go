package console_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/console"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// BenchmarkConsolePayloads measures what one request allocates (B/op,
// with -benchmem: the whole process, so the handler's work and the
// client's reading of the body) when what it lists or shows has large
// payloads: 24 quarantined outbox rows and 24 parked messages (PostgreSQL
// and Redis) of 4 MiB each, the relay's typical quarantine (a message the
// broker refused as too large). Each request goes through the real
// handler over HTTP (an httptest server, a bearer token); the body is
// read and dropped.
//
//	go test -run '^$' -bench ConsolePayloads -benchmem -benchtime 10x ./console/
//
// Sub-benchmarks: api_outbox_rows (GET /api/v1/outbox/rows, the 24 rows),
// api_outbox_row (GET /api/v1/outbox/rows/{id}), page_outbox (/outbox),
// page_outbox_row (/outbox/rows/{id}); api_parked, api_parked_one,
// page_parked, page_parked_one, the same for parked messages;
// redis_api_parked_one and redis_page_parked_one, one message of the
// Redis store.
func BenchmarkConsolePayloads(b *testing.B) {
	const (
		rows     = 24
		size     = 4 << 20
		token    = "bench-console-token-0123456789abcdef"
		consumer = "bench-consumer"
		timeout  = 5 * time.Minute
	)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	db := testenv.Schema(b).WithDefaults()
	inner, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	require.NoError(b, err)
	rc := testenv.Redis(b)
	rs, err := redisstore.New(redisstore.Config{Client: rc, Prefix: testenv.RedisPrefix(b, rc)})
	require.NoError(b, err)

	// A payload of UTF-8 text that compresses about as JSON does: hex.
	raw := make([]byte, size/2)
	_, _ = rand.Read(raw)
	payload := []byte(hex.EncodeToString(raw))
	var firstRow int64
	for i := range rows {
		var id int64
		err := seam.QueryRow(ctx, db.Conn, `INSERT INTO `+db.Outbox()+` (topic, uuid, payload, metadata, failures, attempts, last_error, quarantined_at)
VALUES ('invoices.issued', $1, $2, '{"order_id": "A-1"}', 5, 5, 'PRECONDITION_FAILED - message size 4194304 is larger than configured max size 2097152', now())
RETURNING id`, []any{fmt.Sprintf("row-%d", i), payload}, &id)
		require.NoError(b, err)
		if i == 0 {
			firstRow = id
		}
		key := fmt.Sprintf("key-%d", i)
		msg := &inboxdb.ParkedMessage{UUID: "uuid-" + key, Topic: "orders", Payload: payload, PayloadSize: len(payload),
			Metadata: map[string]string{"order_id": "A-1"}}
		require.NoError(b, inner.Park(ctx, db.Conn, consumer, key, "permanent: too large", msg))
		lb := leasestore.BackendOf(rs)
		claim, err := lb.Claim(ctx, consumer, key, leasestore.Options{Lease: time.Minute})
		require.NoError(b, err)
		require.NoError(b, lb.Fail(ctx, leasestore.Attempt{Consumer: consumer, Key: key, Token: claim.Token, Message: msg}, "permanent: too large", true))
	}

	h, err := console.New(console.Config{DB: db, Redis: rs, Auth: console.BearerToken(token), StatsInterval: time.Hour,
		Logger: slog.New(slog.DiscardHandler)})
	require.NoError(b, err)
	srv := httptest.NewServer(h)
	b.Cleanup(srv.Close)
	client := srv.Client()

	get := func(b *testing.B, path string) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+path, nil)
		require.NoError(b, err)
		req.Header.Set("Authorization", "Bearer "+token)
		resp, err := client.Do(req)
		require.NoError(b, err)
		n, err := io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		require.NoError(b, err)
		if resp.StatusCode != http.StatusOK {
			b.Fatalf("GET %s: %d (%d bytes)", path, resp.StatusCode, n)
		}
		b.ReportMetric(float64(n), "body-bytes")
	}
	for _, c := range []struct{ name, path string }{
		{"api_outbox_rows", "/api/v1/outbox/rows"},
		{"api_outbox_row", fmt.Sprintf("/api/v1/outbox/rows/%d", firstRow)},
		{"page_outbox", "/outbox"},
		{"page_outbox_row", fmt.Sprintf("/outbox/rows/%d", firstRow)},
		{"api_parked", "/api/v1/parked?consumer=" + consumer},
		{"api_parked_one", "/api/v1/parked/" + consumer + "/key-0"},
		{"page_parked", "/parked?consumer=" + consumer},
		{"page_parked_one", "/parked/" + consumer + "/key-0"},
		{"redis_api_parked_one", "/api/v1/parked/" + consumer + "/key-0?store=redis"},
		{"redis_page_parked_one", "/parked/" + consumer + "/key-0?store=redis"},
	} {
		b.Run(c.name, func(b *testing.B) {
			get(b, c.path) // warm: the connection, the templates
			b.ResetTimer()
			for b.Loop() {
				get(b, c.path)
			}
		})
	}
}
