package main

import (
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// TestRelayPartitions: `outbox relay --topic-partitions topic=n` sends each
// message to the partition queue of its ordering key, in order; a bad value
// is a usage error.
func TestRelayPartitions(t *testing.T) {
	db := testenv.Schema(t)
	topic := testenv.Unique(t, "cli_part_")
	const n = 3
	conn := testenv.AMQPConn(t)
	t.Cleanup(func() {
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		for i := range n {
			_, _ = ch.QueueDelete(rabbitmq.PartitionQueue(topic, i), false, false, false)
		}
	})
	tx, err := db.Conn.BeginTx(testCtx(t), nil)
	require.NoError(t, err)
	w, err := outbox.NewWriter(db)
	require.NoError(t, err)
	pub, err := w.Publisher(tx)
	require.NoError(t, err)
	for seq := range 4 {
		for _, key := range []string{"a", "b", "c", "d"} {
			m := message.NewMessage(fmt.Sprintf("%s-%d", key, seq), []byte(fmt.Sprint(seq)))
			require.NoError(t, pub.Publish(topic, msgid.SetOrderingKey(m, key)))
		}
	}
	require.NoError(t, tx.Commit())

	env := append(dbEnv(db.Schema), envAMQPURL+"="+testenv.AMQPURL())
	r := cli(t, env, "outbox", "relay", "--topic-partitions", fmt.Sprintf("%s=%d", topic, n), "--once")
	requireOK(t, r)
	require.Contains(t, r.stdout, "Relayed 16 messages")

	ch, err := conn.Channel()
	require.NoError(t, err)
	got := map[string][]string{}
	for i := range n {
		q := rabbitmq.PartitionQueue(topic, i)
		for {
			d, ok, err := ch.Get(q, true)
			require.NoError(t, err)
			if !ok {
				break
			}
			key, _ := d.Headers[msgid.OrderingKeyMetadata].(string)
			require.Equal(t, rabbitmq.Partition(key, n), i, "key %s", key)
			got[key] = append(got[key], string(d.Body))
		}
	}
	for _, key := range []string{"a", "b", "c", "d"} {
		require.Equal(t, []string{"0", "1", "2", "3"}, got[key], "key %s", key)
	}
	_, err = ch.QueueDeclare(rabbitmq.PartitionQueue(topic, 0), true, false, false, false, nil)
	var amqpErr *amqp.Error
	require.ErrorAs(t, err, &amqpErr, "declared with single active consumer: a plain declaration is refused")

	r = cli(t, env, "outbox", "relay", "--topic-partitions", topic+"=0", "--once")
	require.Equal(t, exitUsage, r.code, "%s", r)
	require.Contains(t, r.stderr, "0 partitions, it must be between 1 and 1024")
}

// TestParkedRedisReplayPartitions: a message parked by a consumer of a
// partitioned topic (Redis lease store) is replayed with --topic-partitions to
// the partition queue of its ordering key, where the consumer reads it;
// without the flag it would go to the queue named like the topic, which
// no partitioned consumer reads.
func TestParkedRedisReplayPartitions(t *testing.T) {
	t.Parallel()
	rdb := testenv.Redis(t)
	prefix := testenv.RedisPrefix(t, rdb)
	store, err := redisstore.New(redisstore.Config{Client: rdb, Prefix: prefix})
	require.NoError(t, err)
	topic := testenv.Unique(t, "cli_part_redis_")
	const n = 2
	conn := testenv.AMQPConn(t)
	t.Cleanup(func() {
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		for i := range n {
			_, _ = ch.QueueDelete(rabbitmq.PartitionQueue(topic, i), false, false, false)
		}
		_, _ = ch.QueueDelete(topic, false, false, false)
	})
	require.NoError(t, rabbitmq.DeclarePartitions(testCtx(t), testenv.AMQPURL(), topic, n))

	h := &poisonHandler{effect: map[string]int{}}
	ev := &events{}
	eo, err := exactlyonce.New(exactlyonce.Config{Lease: &exactlyonce.LeaseConfig{Duration: 10 * time.Second, Store: store},
		OnEvent: ev.observe, Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(eo.Middleware)
	sub, err := wamqp.NewSubscriber(testenv.PartitionSubscriberConfig(testenv.AMQPURL()), watermill.NopLogger{})
	require.NoError(t, err)
	// The router closes its handlers' subscribers only when it is closed,
	// not when its context ends first (StartRouter's cleanup cancels it).
	t.Cleanup(func() { _ = sub.Close() })
	r.AddConsumerHandler("ship-order", topic, rabbitmq.PartitionedSubscriber(sub, n), h.handle)
	testenv.StartRouter(t, r)

	pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: testenv.AMQPURL(), Partitions: map[string]int{topic: n}})
	require.NoError(t, err)
	t.Cleanup(func() { _ = pub.Close() })
	uuid := watermill.NewUUID()
	m := message.NewMessage(uuid, []byte(`{"order":"P-1"}`))
	m.Metadata.Set("order_id", "P-1")
	m.Metadata.Set("bad", "1")
	require.NoError(t, pub.Publish(topic, msgid.SetOrderingKey(m, "customer-9")))
	testenv.Eventually(t, 20*time.Second, func() bool { return ev.count(exactlyonce.Parked) == 1 }, "parked in Redis")

	h.fix()
	env := []string{"REDIS_URL=" + testenv.RedisURL(), envRedisPrefix + "=" + prefix, envAMQPURL + "=" + testenv.AMQPURL()}
	requireExit(t, cli(t, env, "parked", "replay", "--redis-url", "", "--topic-partitions", topic+"=0", "ship-order", uuid), exitUsage, "0 partitions")
	requireOK(t, cli(t, env, "parked", "replay", "--redis-url", "", "--topic-partitions", fmt.Sprintf("%s=%d", topic, n), "ship-order", uuid))
	testenv.Eventually(t, 20*time.Second, func() bool { return h.effects("P-1") == 1 }, "the replayed order is processed from its partition")
}
