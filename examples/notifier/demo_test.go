package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// TestDemo runs the demo (on its own schema and queues) and checks what it
// measured: every figure of the printed table, taken in the run, and that it
// left neither its schema nor its queues behind.
func TestDemo(t *testing.T) {
	t.Parallel()
	names := demoNames{
		schema: testenv.Unique(t, "ntdemo_"),
		send:   testenv.Unique(t, "ntdemo_send_"),
		sent:   testenv.Unique(t, "ntdemo_sent_"),
		dead:   testenv.Unique(t, "ntdemo_dead_"),
	}
	cfg, err := LoadConfig()
	require.NoError(t, err)
	cfg.DatabaseURL, cfg.AMQPURL = testenv.DatabaseURL(), testenv.AMQPURL()
	pool := testenv.Pool(t)
	amqpConn := testenv.AMQPConn(t)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	f, err := demo(ctx, slog.New(slog.NewTextHandler(io.Discard, nil)), cfg, names)
	require.NoError(t, err)

	published := 0
	for _, s := range demoSamples {
		published += s.copies
	}
	require.Equal(t, demoFigures{
		Published: published + 1, // the malformed request counts
		Distinct:  len(demoSamples),
		Copies:    published - len(demoSamples),
		Malformed: 1,

		DeadLettered: 1,
		Deliveries:   published + 1, // every copy, and the redelivery of the lost ack
		Redeliveries: 1,
		Duplicates:   published - len(demoSamples) + 1, // the copies and the redelivery

		ProviderKeys:     len(demoSamples),
		ProviderRequests: len(demoSamples),
		LogRows:          len(demoSamples),
		Events:           len(demoSamples),
	}, f)
	require.True(t, f.exactlyOnce())

	var out bytes.Buffer
	printDemo(&out, f)
	require.Contains(t, out.String(), "exactly once")
	for _, where := range []string{"/metrics", "docs/operations/grafana-dashboard.json", "docs/operations/alerts.yml",
		"go run github.com/exactlyonce/watermill-exactlyonce/cmd/exactlyonce inbox stats"} {
		require.Contains(t, out.String(), where, "the demo ends saying where to look")
	}

	// Nothing left behind.
	var schemas int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_namespace WHERE nspname = $1`, names.schema).Scan(&schemas))
	require.Zero(t, schemas, "the demo's schema is dropped")
	for _, q := range []string{names.send, names.sent, names.dead} {
		ch, err := amqpConn.Channel()
		require.NoError(t, err)
		_, err = ch.QueueDeclarePassive(q, true, false, false, false, nil)
		var ae *amqp.Error
		require.ErrorAs(t, err, &ae, "queue %s still exists", q)
		require.Equal(t, amqp.NotFound, ae.Code, "queue %s", q)
	}
}
