package rabbitmq

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/msgid"
)

// A channel on which the broker nacked a message is closed, not reused: a
// quorum queue on RabbitMQ 3.10 nacks every later publish of such a
// channel while its old leader's node is down (tests/cluster:
// TestQuorumPublisherConfirmsWhenTheLeaderDies), when a new channel's
// publishes are confirmed. Here the nacks come from a full queue
// (x-overflow reject-publish); the next call publishes on a new channel.
func TestPublisherClosesAChannelThatNacked(t *testing.T) {
	t.Parallel()
	url := os.Getenv("AMQP_URL")
	if url == "" {
		url = "amqp://guest:guest@127.0.0.1:5672/"
	}
	conn, err := amqp091.Dial(url)
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("RabbitMQ unreachable: %v", err)
		}
		t.Skipf("RabbitMQ unreachable: %v", err)
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	require.NoError(t, err)
	q := "rabbitmq-test-nack-" + watermill.NewShortUUID()
	_, err = ch.QueueDeclare(q, true, false, false, false, amqp091.Table{"x-max-length": int64(1), "x-overflow": "reject-publish"})
	require.NoError(t, err)
	defer func() { _, _ = ch.QueueDelete(q, false, false, false) }()

	p, err := NewPublisher(PublisherConfig{URL: url, NoQueueDeclare: true})
	require.NoError(t, err)
	defer func() { require.NoError(t, p.Close()) }()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	batch := func(uuids ...string) []msgid.TopicMessage {
		var b []msgid.TopicMessage
		for _, u := range uuids {
			b = append(b, msgid.TopicMessage{Topic: q, Message: message.NewMessage(u, []byte("{}"))})
		}
		return b
	}
	errs := p.PublishBatch(ctx, batch("a"))
	require.NoError(t, errs[0])
	p.mu.Lock()
	require.Len(t, p.idle, 1, "a channel whose messages were confirmed is reused")
	first := p.idle[0]
	p.mu.Unlock()

	errs = p.PublishBatch(ctx, batch("b", "c"))
	require.ErrorContains(t, errs[0], "nacked")
	require.ErrorContains(t, errs[1], "nacked")
	p.mu.Lock()
	idle := len(p.idle)
	p.mu.Unlock()
	require.Zero(t, idle, "the channel that nacked is not kept")
	require.Eventually(t, first.ch.IsClosed, 5*time.Second, 10*time.Millisecond, "the channel that nacked is closed")

	_, err = ch.QueuePurge(q, false)
	require.NoError(t, err)
	errs = p.PublishBatch(ctx, batch("d"))
	require.NoError(t, errs[0], "the next call publishes on a new channel")
}
