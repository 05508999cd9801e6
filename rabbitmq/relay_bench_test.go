package rabbitmq_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// benchBacklog is the number of rows each iteration of a relay benchmark
// relays.
const benchBacklog = 10_000

// benchRelay measures an outbox Relay (BatchSize 500) draining a backlog of
// benchBacklog rows to one durable queue through the publisher newPub
// returns, with 1 and 4 workers, and reports events/s. The rows are written
// and the queue purged outside the timer.
func benchRelay(b *testing.B, newPub func(b *testing.B, amqpURL string) message.Publisher) {
	amqpURL := amqpURL(b)
	db := schema(b)
	q := uniqueQueue(b, amqpURL, "bench")
	require.NoError(b, rabbitmq.DeclareQueues(context.Background(), amqpURL, q))
	ch := rawChannel(b, amqpURL)
	pool := testenv.Pool(b)
	for _, workers := range []int{1, 4} {
		b.Run(fmt.Sprintf("workers=%d", workers), func(b *testing.B) {
			pub := newPub(b, amqpURL)
			relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: pub, Logger: watermill.NopLogger{}, BatchSize: 500})
			require.NoError(b, err)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			seq := 0
			relayed := 0
			for b.Loop() {
				b.StopTimer()
				_, err := ch.QueuePurge(q, false)
				require.NoError(b, err)
				_, err = pool.Exec(ctx, "INSERT INTO "+db.Outbox()+` (topic, uuid, payload, metadata)
SELECT $1, 'bench-' || g, convert_to('{"n":' || g || '}', 'UTF8'), '{"source":"bench"}'
FROM generate_series($2::bigint, $3::bigint) g`, q, seq+1, seq+benchBacklog)
				require.NoError(b, err)
				seq += benchBacklog
				b.StartTimer()

				var wg sync.WaitGroup
				var mu sync.Mutex
				for range workers {
					wg.Go(func() {
						for {
							n, err := relay.Flush(ctx)
							if err != nil {
								b.Error(err)
								return
							}
							if n == 0 {
								return
							}
							mu.Lock()
							relayed += n
							mu.Unlock()
						}
					})
				}
				wg.Wait()
			}
			b.StopTimer()
			require.Equal(b, b.N*benchBacklog, relayed)
			b.ReportMetric(float64(relayed)/b.Elapsed().Seconds(), "events/s")
		})
	}
}

// BenchmarkRelayConfirmWindow: the relay through rabbitmq.Publisher (one
// PublishBatch per batch, a window of 256 confirms). "serialized" puts a
// mutex around PublishBatch: one channel, one batch in flight at a time.
func BenchmarkRelayConfirmWindow(b *testing.B) {
	b.Run("channel-per-call", func(b *testing.B) {
		benchRelay(b, func(b *testing.B, amqpURL string) message.Publisher {
			return newPublisher(b, rabbitmq.PublisherConfig{URL: amqpURL})
		})
	})
	b.Run("serialized", func(b *testing.B) {
		benchRelay(b, func(b *testing.B, amqpURL string) message.Publisher {
			return &serialized{Publisher: newPublisher(b, rabbitmq.PublisherConfig{URL: amqpURL})}
		})
	})
}

// serialized is a Publisher whose PublishBatch calls take turns.
type serialized struct {
	*rabbitmq.Publisher
	mu sync.Mutex
}

func (s *serialized) PublishBatch(ctx context.Context, batch []msgid.TopicMessage) []error {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.Publisher.PublishBatch(ctx, batch)
}

// BenchmarkRelayWatermillAMQP: the relay through watermill-amqp v3's
// publisher with ConfirmDelivery (one confirm awaited per message), with no
// channel pool (what the docs recommend) and with a pool of 16.
func BenchmarkRelayWatermillAMQP(b *testing.B) {
	for _, pool := range []int{0, 16} {
		b.Run(fmt.Sprintf("pool=%d", pool), func(b *testing.B) {
			benchRelay(b, func(b *testing.B, amqpURL string) message.Publisher {
				cfg := wamqp.NewDurableQueueConfig(amqpURL)
				cfg.Marshaler = rabbitmq.Marshaler{}
				cfg.Publish.ConfirmDelivery = true
				cfg.Publish.ChannelPoolSize = pool
				pub, err := wamqp.NewPublisher(cfg, watermill.NopLogger{})
				require.NoError(b, err)
				b.Cleanup(func() { _ = pub.Close() })
				return pub
			})
		})
	}
}
