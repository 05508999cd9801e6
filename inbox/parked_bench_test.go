package inbox_test

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// BenchmarkFindParkedByMetadata finds one parked message by a business id
// in its metadata (FindParked with Metadata {"order_id": ...}) among
// PARKED_BENCH_ROWS parked messages (default 100,000; the docs quote
// 1,000,000) of 20 consumers, each with a 200-byte payload and three
// metadata fields, and reports the table's bytes per parked message:
//
//	PARKED_BENCH_ROWS=1000000 go test -run '^$' -bench FindParkedByMetadata -benchtime 200x ./inbox/
func BenchmarkFindParkedByMetadata(b *testing.B) {
	rows := 100_000
	if s := os.Getenv("PARKED_BENCH_ROWS"); s != "" {
		n, err := strconv.Atoi(s)
		require.NoError(b, err, "PARKED_BENCH_ROWS")
		rows = n
	}
	db := testenv.Schema(b)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	store, err := inbox.NewStore(db)
	require.NoError(b, err)
	d := db.WithDefaults()
	parked := pgx.Identifier{d.Schema, d.InboxTable + "_parked"}.Sanitize()
	_, err = db.Conn.ExecContext(ctx, `INSERT INTO `+parked+` (consumer, message_key, message_uuid, topic, payload, payload_size, metadata, reason, attempts, first_seen_at, parked_at)
SELECT 'consumer-' || (g % 20), 'key-' || g, md5(g::text), 'orders.placed',
  convert_to(substr(repeat(md5(g::text), 7), 1, 200), 'UTF8'), 200,
  jsonb_build_object('order_id', 'ORD-' || g, 'customer_id', 'CUS-' || (g % 50000), 'source', (ARRAY['web', 'api', 'batch'])[g % 3 + 1]),
  'permanent: invalid shipping address for order ORD-' || g, 1,
  now() - make_interval(secs => ($1 - g) * 2.6 + 60), now() - make_interval(secs => ($1 - g) * 2.6)
FROM generate_series(1, $1::int) g`, rows)
	require.NoError(b, err)
	_, err = db.Conn.ExecContext(ctx, `INSERT INTO `+db.Inbox()+` (consumer, message_key, status, attempts, processed_at)
SELECT 'consumer-' || (g % 20), 'key-' || g, 'parked', 1, now() FROM generate_series(1, $1::int) g`, rows)
	require.NoError(b, err)
	_, err = db.Conn.ExecContext(ctx, `VACUUM ANALYZE `+parked)
	require.NoError(b, err)
	_, err = db.Conn.ExecContext(ctx, `ANALYZE `+db.Inbox())
	require.NoError(b, err)
	var size int64
	require.NoError(b, seam.QueryRow(ctx, db.Conn, `SELECT pg_total_relation_size($1::regclass)`, []any{parked}, &size))

	i := 0
	b.ResetTimer()
	for b.Loop() {
		i = (i*7919 + 104729) % rows
		order := fmt.Sprintf("ORD-%d", i+1)
		page, err := store.FindParked(ctx, inbox.ParkedFilter{Metadata: map[string]string{"order_id": order}}, inbox.Page{})
		if err != nil || len(page.Messages) != 1 {
			b.Fatalf("order %s: %d messages, %v", order, len(page.Messages), err)
		}
	}
	b.ReportMetric(float64(size)/float64(rows), "bytes/parked")
}
