package main

import (
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// TestRelayPartitions: `outbox relay --partitions topic=n` sends each
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
	pub, err := outbox.NewPublisher(tx, db)
	require.NoError(t, err)
	for seq := range 4 {
		for _, key := range []string{"a", "b", "c", "d"} {
			m := message.NewMessage(fmt.Sprintf("%s-%d", key, seq), []byte(fmt.Sprint(seq)))
			require.NoError(t, pub.Publish(topic, outbox.SetOrderingKey(m, key)))
		}
	}
	require.NoError(t, tx.Commit())

	env := append(dbEnv(db.Schema), envAMQPURL+"="+testenv.AMQPURL())
	r := cli(t, env, "outbox", "relay", "--partitions", fmt.Sprintf("%s=%d", topic, n), "--once")
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
			key, _ := d.Headers[outbox.OrderingKeyMetadata].(string)
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

	r = cli(t, env, "outbox", "relay", "--partitions", topic+"=0", "--once")
	require.Equal(t, exitUsage, r.code, "%s", r)
	require.Contains(t, r.stderr, "0 partitions, it must be between 1 and 1024")
}
