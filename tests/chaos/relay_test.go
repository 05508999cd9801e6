package chaos

import (
	"context"
	"fmt"
	mrand "math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// relayPoisonKey marks a row whose message RabbitMQ refuses for good: the
// marshaler puts its value in the expiration property, which is not a
// number (PRECONDITION_FAILED, the channel closed).
const relayPoisonKey = "chaos_relay_poison"

type refusedExpiration struct{}

func (refusedExpiration) Marshal(msg *message.Message) (amqp.Publishing, error) {
	p, err := rabbitmq.Marshaler{}.Marshal(msg)
	if v := msg.Metadata.Get(relayPoisonKey); v != "" && err == nil {
		p.Expiration = v
	}
	return p, err
}

// TestChaosRelay: the relay quarantines a row only for a failure that is the
// message's own, whatever the broker does around it. Two relay instances
// (two Relay values, each with its own rabbitmq.Publisher, Workers 4,
// MaxAttempts 1: a single failure counted against a healthy row would
// quarantine it) share one outbox while writers keep adding rows. Their
// connections to RabbitMQ go through a proxy that cuts them again and again
// (the broker flaps); one destination queue is bounded (x-max-length,
// overflow reject-publish) and drained by a slow consumer, so the broker
// nacks while it is full (back-pressure); poison rows (an expiration
// RabbitMQ refuses) are spread among the others.
//
// Invariants: no healthy row quarantined; every poison row quarantined and
// reported (PendingStats, the relays' Stats); nothing lost (every healthy
// row consumed); every message consumed is a healthy row's, with its
// original UUID; the outbox holds only the quarantined rows. The
// watermill-amqp relay (a publisher that cannot tell causes apart, poison
// checked before publishing) runs in TestChaos's worker processes.
func TestChaosRelay(t *testing.T) {
	const (
		writers       = 4
		rowsPerWriter = 600 // healthy rows, each writer alternating the two queues
		poisonEvery   = 97  // every poisonEvery-th row of a writer is poison
		bounded       = 25  // x-max-length of the back-pressured queue
	)
	db := testenv.Schema(t)
	amqpURL := testenv.AMQPURL()
	fast, slow := testenv.Queue(t, "relay_fast_"), testenv.Unique(t, "relay_slow_")
	admin := testenv.AMQPConn(t)
	ch, err := admin.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(slow, true, false, false, false, amqp.Table{"x-max-length": int32(bounded), "x-overflow": "reject-publish"})
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = ch.QueueDelete(slow, false, false, false) })

	// The consumers, straight to RabbitMQ: fast on one queue, slow (4 ms a
	// message, one at a time) on the bounded one.
	var (
		mu       sync.Mutex
		consumed = map[string]int{} // topic/uuid
	)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var consumers sync.WaitGroup
	consume := func(queue string, prefetch int, each time.Duration) {
		c, err := admin.Channel()
		require.NoError(t, err)
		require.NoError(t, c.Qos(prefetch, 0, false))
		deliveries, err := c.Consume(queue, "", false, false, false, false, nil)
		require.NoError(t, err)
		consumers.Go(func() {
			defer func() { _ = c.Close() }()
			for {
				select {
				case <-ctx.Done():
					return
				case d, ok := <-deliveries:
					if !ok {
						return
					}
					time.Sleep(each)
					m, err := rabbitmq.Marshaler{}.Unmarshal(d)
					if err == nil {
						mu.Lock()
						consumed[queue+"/"+m.UUID]++
						mu.Unlock()
					}
					_ = d.Ack(false)
				}
			}
		})
	}
	consume(fast, 200, 0)
	consume(slow, 1, 4*time.Millisecond)
	defer consumers.Wait()
	defer cancel()

	// The relays, through a proxy that flaps.
	proxy := testenv.NewProxy(t, hostPort(t, amqpURL, "5672"))
	var relays []*outbox.Relay
	var relaying sync.WaitGroup
	for i := range 2 {
		pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: proxy.RewriteURL(amqpURL), Window: 64, NoQueueDeclare: true, Marshaler: refusedExpiration{}})
		require.NoError(t, err)
		defer func() { require.NoError(t, pub.Close()) }()
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: db, Publisher: pub, Logger: testenv.Logger(t), BatchSize: 50, Workers: 4, MaxAttempts: 1,
			PollInterval: 20 * time.Millisecond, ErrorBackoff: 20 * time.Millisecond, MaxErrorBackoff: 300 * time.Millisecond,
		})
		require.NoError(t, err, "relay %d", i)
		relays = append(relays, relay)
		relaying.Go(func() { require.NoError(t, relay.Run(ctx)) })
	}
	defer relaying.Wait()
	defer cancel()

	// The writers, while the proxy flaps.
	var (
		healthy, poison []string // topic/uuid
		wmu             sync.Mutex
	)
	var writing sync.WaitGroup
	ob, err := outbox.NewWriter(db)
	require.NoError(t, err)
	for w := range writers {
		writing.Go(func() {
			rng := mrand.New(mrand.NewPCG(uint64(w), 7))
			for start := 0; start < rowsPerWriter; {
				n := 1 + rng.IntN(20)
				tx, err := db.Conn.BeginTx(ctx, nil)
				if !assertNoError(t, err) {
					return
				}
				pub, err := ob.Publisher(tx)
				if !assertNoError(t, err) {
					return
				}
				var h, p []string
				for i := start; i < min(start+n, rowsPerWriter); i++ {
					topic := []string{fast, slow}[i%2]
					m := message.NewMessage(fmt.Sprintf("w%d-%05d", w, i), []byte(fmt.Sprintf(`{"w":%d,"i":%d}`, w, i)))
					if i%poisonEvery == poisonEvery-1 {
						m.UUID = "poison-" + m.UUID
						m.Metadata.Set(relayPoisonKey, "not-a-number")
						p = append(p, topic+"/"+m.UUID)
					} else {
						h = append(h, topic+"/"+m.UUID)
					}
					if !assertNoError(t, pub.Publish(topic, m)) {
						return
					}
				}
				if !assertNoError(t, tx.Commit()) {
					return
				}
				wmu.Lock()
				healthy, poison = append(healthy, h...), append(poison, p...)
				wmu.Unlock()
				start += n
				time.Sleep(time.Duration(20+rng.IntN(100)) * time.Millisecond) // rows keep arriving for seconds
			}
		})
	}
	written := make(chan struct{})
	go func() { writing.Wait(); close(written) }()
	cuts := 0
	rng := mrand.New(mrand.NewPCG(1, 2))
flapping:
	for {
		select {
		case <-written:
			break flapping
		case <-time.After(time.Duration(150+rng.IntN(350)) * time.Millisecond):
		}
		proxy.Refuse()
		cuts++
		time.Sleep(time.Duration(50+rng.IntN(200)) * time.Millisecond)
		proxy.Allow()
	}
	// Two more cuts once every row is written, while they drain.
	for range 2 {
		time.Sleep(200 * time.Millisecond)
		proxy.Refuse()
		cuts++
		time.Sleep(100 * time.Millisecond)
		proxy.Allow()
	}

	settled := func() bool {
		p, err := testenv.OutboxStore(t, db).Pending(ctx)
		if err != nil || p.Count != p.Quarantined || p.Quarantined < int64(len(poison)) {
			return false
		}
		mu.Lock()
		defer mu.Unlock()
		for _, k := range healthy {
			if consumed[k] == 0 {
				return false
			}
		}
		return true
	}
	deadline := time.Now().Add(90 * time.Second)
	for !settled() {
		if time.Now().After(deadline) {
			p, err := testenv.OutboxStore(t, db).Pending(context.Background())
			mu.Lock()
			missing := 0
			var sample []string
			for _, k := range healthy {
				if consumed[k] == 0 {
					if missing++; missing <= 5 {
						sample = append(sample, k)
					}
				}
			}
			mu.Unlock()
			t.Logf("not settled: %+v (%v); %d healthy rows not consumed, e.g. %v", p, err, missing, sample)
			rows, err := db.Conn.QueryContext(context.Background(), `SELECT id, topic, uuid, failures, attempts, quarantined_at IS NOT NULL,
coalesce((next_attempt_at - now())::text, ''), coalesce(left(last_error, 160), '') FROM `+db.Outbox()+` ORDER BY id LIMIT 20`)
			if err == nil {
				for rows.Next() {
					var id, failures, attempts int64
					var topic, uuid, next, lastErr string
					var q bool
					if rows.Scan(&id, &topic, &uuid, &failures, &attempts, &q, &next, &lastErr) == nil {
						t.Logf("row %d %s/%s: failures %d, permanent %d, quarantined %v, next in %s: %s", id, topic, uuid, failures, attempts, q, next, lastErr)
					}
				}
				_ = rows.Close()
			}
			for i, r := range relays {
				t.Logf("relay %d: %+v", i, r.Stats())
			}
			for _, q := range []string{fast, slow} {
				if c, err := admin.Channel(); err == nil {
					st, err := c.QueueDeclarePassive(q, true, false, false, false, nil)
					t.Logf("queue %s: %+v %v", q, st, err)
					_ = c.Close()
				}
			}
			t.FailNow()
		}
		time.Sleep(50 * time.Millisecond)
	}
	cancel()
	relaying.Wait()
	consumers.Wait()

	p, err := testenv.OutboxStore(t, db).Pending(context.Background())
	require.NoError(t, err)
	var quarantined []string
	rows, err := db.Conn.QueryContext(context.Background(), `SELECT topic || '/' || uuid FROM `+db.Outbox()+` WHERE quarantined_at IS NOT NULL ORDER BY 1`)
	require.NoError(t, err)
	for rows.Next() {
		var k string
		require.NoError(t, rows.Scan(&k))
		quarantined = append(quarantined, k)
	}
	require.NoError(t, rows.Close())
	var relayed, failed, q int64
	for _, r := range relays {
		st := r.Stats()
		relayed, failed, q = relayed+st.Relayed, failed+st.FailedPublishes, q+st.Quarantined
	}
	dups, foreign := 0, []string{}
	want := map[string]bool{}
	for _, k := range healthy {
		want[k] = true
	}
	for k, n := range consumed {
		if !want[k] {
			foreign = append(foreign, k)
		}
		dups += n - 1
	}
	var healthyQuarantined []string
	for _, k := range quarantined {
		if !strings.Contains(k, "/poison-") {
			healthyQuarantined = append(healthyQuarantined, k)
		}
	}
	t.Logf("%d healthy rows, %d poison rows; %d connection cuts; relayed %d, %d failed publishes, %d quarantined; %d consumed twice or more",
		len(healthy), len(poison), cuts, relayed, failed, q, dups)
	require.Positive(t, failed, "nothing failed: the broker's faults did not happen")
	require.Empty(t, healthyQuarantined, "healthy rows quarantined")
	require.ElementsMatch(t, poison, quarantined, "every poison row quarantined, and only those")
	require.Equal(t, int64(len(poison)), p.Quarantined, "PendingStats reports the quarantined rows")
	require.Equal(t, int64(len(poison)), q, "the relays report the rows they quarantined")
	require.Equal(t, p.Quarantined, p.Count, "the outbox holds only the quarantined rows")
	require.Empty(t, foreign, "consumed messages that are no healthy row (a poison row, or a UUID not original)")
	require.Equal(t, int64(len(healthy)), relayed, "each healthy row deleted once, after its confirm")
}

// assertNoError is require.NoError for goroutines: it records the failure
// and reports whether err was nil.
func assertNoError(t *testing.T, err error) bool {
	t.Helper()
	if err != nil {
		t.Errorf("%v", err)
		return false
	}
	return true
}
