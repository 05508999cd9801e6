package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// TestDemo runs the demo (on its own schema and queues) on each database
// engine and checks what it measured: every figure of the printed table,
// taken in the run, the same on both, and that it left neither its schema
// nor its queues behind.
func TestDemo(t *testing.T) {
	t.Parallel()
	for _, engine := range []struct {
		name    string
		url     func() string
		printed string // the engine's name in the printed table
		// db reaches the server, and schemas counts the schemas (MySQL:
		// databases) of a name on it.
		db      func(t *testing.T) wsql.ContextExecutor
		schemas string
	}{
		{
			name:    "postgres",
			url:     testenv.DatabaseURL,
			printed: "PostgreSQL",
			db:      func(t *testing.T) wsql.ContextExecutor { return wsql.BeginnerFromPgx(testenv.Pool(t)) },
			schemas: `SELECT count(*) FROM pg_namespace WHERE nspname = $1`,
		},
		{
			name:    testenv.MariaDB,
			url:     testenv.MySQLURL,
			printed: "MySQL/MariaDB",
			db:      func(t *testing.T) wsql.ContextExecutor { return wsql.BeginnerFromStdSQL(testenv.MySQLDB(t)) },
			schemas: `SELECT count(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = ?`,
		},
	} {
		t.Run(engine.name, func(t *testing.T) {
			t.Parallel()
			testDemo(t, engine.url(), engine.printed, engine.db(t), engine.schemas)
		})
	}
}

func testDemo(t *testing.T, databaseURL, wantEngine string, db wsql.ContextExecutor, countSchemas string) {
	names := demoNames{
		schema: testenv.Unique(t, "ntdemo_"),
		send:   testenv.Unique(t, "ntdemo_send_"),
		sent:   testenv.Unique(t, "ntdemo_sent_"),
		dead:   testenv.Unique(t, "ntdemo_dead_"),
	}
	cfg, err := LoadConfig()
	require.NoError(t, err)
	cfg.DatabaseURL, cfg.AMQPURL = databaseURL, testenv.AMQPURL()
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
	printDemo(&out, engineName(dialectOf(databaseURL)), f)
	require.Contains(t, out.String(), "exactly once")
	require.Contains(t, out.String(), "lease mode on "+wantEngine)
	for _, where := range []string{"/metrics", "docs/operations/grafana-dashboard.json", "docs/operations/alerts.yml",
		"go run github.com/exactlyonce/watermill-exactlyonce/cmd/exactlyonce inbox stats"} {
		require.Contains(t, out.String(), where, "the demo ends saying where to look")
	}

	// Nothing left behind.
	require.Zero(t, testenv.Count(t, db, countSchemas, names.schema), "the demo's schema is dropped")
	for _, q := range []string{names.send, names.sent, names.dead} {
		ch, err := amqpConn.Channel()
		require.NoError(t, err)
		_, err = ch.QueueDeclarePassive(q, true, false, false, false, nil)
		var ae *amqp.Error
		require.ErrorAs(t, err, &ae, "queue %s still exists", q)
		require.Equal(t, amqp.NotFound, ae.Code, "queue %s", q)
	}
}
