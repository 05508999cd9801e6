package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// nopPublisher accepts everything: the benchmark measures the relay's
// database work only.
type nopPublisher struct{}

func (nopPublisher) Publish(string, ...*message.Message) error { return nil }
func (nopPublisher) Close() error                              { return nil }

// BenchmarkRelayBacklog measures Flush (lock a batch of 100, publish to
// a no-op publisher, delete, commit) with 1k, 20k and 100k rows waiting. The
// backlog is topped up (outside the timer) whenever it fell by 10%, so each
// poll sees about the same backlog. The poll cost should not grow with it:
// rows are picked through the primary key, not by scanning the backlog.
func BenchmarkRelayBacklog(b *testing.B) {
	pool := testenv.Pool(b)
	db := wsql.BeginnerFromPgx(pool)
	bb := newBundle(b, context.Background(), db, testenv.Schema(b))
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: bb.schema(), Publisher: nopPublisher{}, Logger: testenv.Logger(b), BatchSize: 100})
	require.NoError(b, err)

	seq := 0
	fill := func(b *testing.B, n int) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		defer cancel()
		_, err := pool.Exec(ctx, "INSERT INTO "+bb.tables.Outbox()+` (topic, uuid, payload, metadata)
SELECT 'bench', 'bench-' || g, convert_to('{"n":' || g || '}', 'UTF8'), '{"source":"bench"}'
FROM generate_series($1::bigint, $2::bigint) g`, seq+1, seq+n)
		require.NoError(b, err)
		seq += n
	}

	for _, backlog := range []int{1_000, 20_000, 100_000} {
		b.Run(fmt.Sprintf("backlog=%dk", backlog/1000), func(b *testing.B) {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			_, err := pool.Exec(ctx, "TRUNCATE "+bb.tables.Outbox())
			require.NoError(b, err)
			fill(b, backlog)
			_, err = pool.Exec(ctx, "VACUUM ANALYZE "+bb.tables.Outbox())
			require.NoError(b, err)

			left := backlog
			relayed := 0
			b.ResetTimer()
			for b.Loop() {
				n, err := relay.Flush(ctx)
				if err != nil {
					b.Fatal(err)
				}
				if n != 100 {
					b.Fatalf("relayed %d rows with %d waiting, want a full batch of 100", n, left)
				}
				relayed += n
				left -= n
				if left <= backlog*9/10 {
					b.StopTimer()
					fill(b, backlog-left)
					left = backlog
					b.StartTimer()
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(relayed)/b.Elapsed().Seconds(), "rows/s")
			require.Equal(b, int64(left), bb.pending(b, db), "the backlog is where the benchmark left it")
		})
	}
}
