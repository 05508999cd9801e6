package main

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// The forwarder's backlog is written in SQL (a million rows through the
// publisher would take longer than the benchmark): each row must be what
// forwarder.Publisher over watermill-sql's publisher writes.
func TestForwarderFillMatchesPublisher(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin := testenv.Pool(t)
	schema := testenv.Unique(t, "bt_")
	_, err := admin.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize())
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := admin.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		require.NoError(t, err)
	})
	pool, err := newPool(ctx, testenv.DatabaseURL(), 2, schema)
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	const topic, dest = "fwd_check", "some_queue"
	pub, err := wsql.NewPublisher(wsql.BeginnerFromPgx(pool), wsql.PublisherConfig{
		SchemaAdapter: wsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true,
	}, watermill.NopLogger{})
	require.NoError(t, err)
	msg := message.NewMessage("fwd-7", []byte(`{"n":7}`))
	msg.Metadata.Set("source", "bench")
	require.NoError(t, forwarder.NewPublisher(pub, forwarder.PublisherConfig{ForwarderTopic: topic}).Publish(dest, msg))

	table := pgx.Identifier{schema, "watermill_" + topic}.Sanitize()
	_, err = admin.Exec(ctx, forwarderFillSQL(table, dest, 7, 7))
	require.NoError(t, err)

	rows, err := admin.Query(ctx, `SELECT payload::text, metadata::text, length(uuid), transaction_id::text FROM `+table+` ORDER BY "offset"`)
	require.NoError(t, err)
	type row struct {
		payload, metadata string
		uuidLen           int
		xid               string
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
		var x row
		return x, r.Scan(&x.payload, &x.metadata, &x.uuidLen, &x.xid)
	})
	require.NoError(t, err)
	require.Len(t, got, 2)
	require.Equal(t, got[0].payload, got[1].payload, "payload (the envelope)")
	require.Equal(t, got[0].metadata, got[1].metadata, "metadata")
	require.Equal(t, got[0].uuidLen, got[1].uuidLen, "uuid length")
	require.NotEqual(t, got[0].xid, got[1].xid)
}

func TestMedianAndShort(t *testing.T) {
	require.Equal(t, 2.0, median([]float64{3, 1, 2}))
	require.Equal(t, 2.5, median([]float64{4, 1, 2, 3}))
	require.Equal(t, "10k", short(10_000))
	require.Equal(t, "1M", short(1_000_000))
	require.Equal(t, "12,345,678", thousands(12_345_678))
}
