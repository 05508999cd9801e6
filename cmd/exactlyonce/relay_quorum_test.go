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

// TestRelayQuorumSeveralNodes: `outbox relay --queue-type quorum` with
// --amqp-url listing several nodes (the first one down) declares a quorum
// queue through the node that answers and relays every row to it; an
// unknown queue type is a usage error.
func TestRelayQuorumSeveralNodes(t *testing.T) {
	db := testenv.Schema(t)
	topic := testenv.Unique(t, "cli_quorum_")
	t.Cleanup(func() {
		if ch, err := testenv.AMQPConn(t).Channel(); err == nil {
			_, _ = ch.QueueDelete(topic, false, false, false)
		}
	})
	tx, err := db.Conn.BeginTx(testCtx(t), nil)
	require.NoError(t, err)
	w, err := outbox.NewWriter(db)
	require.NoError(t, err)
	pub, err := w.Publisher(tx)
	require.NoError(t, err)
	for i := range 5 {
		require.NoError(t, pub.Publish(topic, message.NewMessage(fmt.Sprintf("q-%d", i), []byte("x"))))
	}
	require.NoError(t, tx.Commit())

	env := dbEnv(db.Schema)
	r := cli(t, env, "outbox", "relay", "--once", "--queue-type", "quorum",
		"--amqp-url", "amqp://guest:guest@127.0.0.1:1/,"+testenv.AMQPURL())
	requireOK(t, r)
	require.Contains(t, r.stdout, "Relayed 5 messages")

	ch, err := testenv.AMQPConn(t).Channel()
	require.NoError(t, err)
	q, err := ch.QueueDeclarePassive(topic, true, false, false, false, nil)
	require.NoError(t, err)
	require.Equal(t, 5, q.Messages)
	_, err = ch.QueueDeclare(topic, true, false, false, false, nil)
	var amqpErr *amqp.Error
	require.ErrorAs(t, err, &amqpErr, "a quorum queue: a classic declaration is refused")
	require.Equal(t, amqp.PreconditionFailed, amqpErr.Code)
	_, err = testenv.AMQPConn(t).Channel() // the refused declaration closed ch
	require.NoError(t, err)
	require.NoError(t, rabbitmq.Queues{Type: rabbitmq.Quorum}.Declare(testCtx(t), []string{testenv.AMQPURL()}, topic))

	r = cli(t, env, "outbox", "relay", "--once", "--queue-type", "stream", "--amqp-url", testenv.AMQPURL())
	require.Equal(t, exitUsage, r.code, "%s", r)
	require.Contains(t, r.stderr, `--queue-type "stream": want classic or quorum`)
}

// TestBrokerConfig: the commands that publish (relay, parked replay, ui)
// read --amqp-url as one URL or a cluster's nodes separated by commas, and
// --queue-type into Queues.
func TestBrokerConfig(t *testing.T) {
	cfg := brokerConfig(" amqp://a:5672/ , amqp://b:5672/,,", "quorum", map[string]int{"t": 2})
	require.Equal(t, []string{"amqp://a:5672/", "amqp://b:5672/"}, cfg.URLs)
	require.Equal(t, rabbitmq.Quorum, cfg.Queues.Type)
	require.Equal(t, 2, cfg.Partitions["t"])
	require.NoError(t, checkQueueType("classic"))
	require.ErrorContains(t, checkQueueType(""), `--queue-type "": want classic or quorum`)
	_, err := rabbitmq.NewPublisher(brokerConfig("", "classic", nil))
	require.ErrorContains(t, err, "URL is required")
}
