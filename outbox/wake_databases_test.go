package outbox_test

import (
	"context"
	"net/url"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// One process writing to two databases whose outbox tables have the same
// schema and name (a database per tenant or per shard), a Writer per
// database: each database's writes wake its own relay. The writers'
// debounce was per table name only: a NOTIFY sent to one database made a
// write to the other, in the next 10 ms, skip its own, and that database's
// relay waited for its poll.
func TestNotifyDebounceIsPerDatabase(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	admin := testenv.Pool(t)
	name := testenv.Unique(t, "eodb_")
	_, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize())
	require.NoError(t, err)
	u, err := url.Parse(testenv.DirectDatabaseURL())
	require.NoError(t, err)
	u.Path = "/" + name
	other := testenv.PoolFor(t, u.String())
	t.Cleanup(func() {
		other.Close()
		_, err := admin.Exec(context.Background(), "DROP DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		require.NoError(t, err)
	})

	first := testenv.Schema(t)
	second := first
	second.Conn = wsql.BeginnerFromPgx(other)
	require.NoError(t, sqlschema.Migrate(ctx, second))

	rec := &recorder{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: second, Publisher: rec, PollInterval: slowPoll, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	runRelay(t, relay)
	waitListening(t, relay)
	time.Sleep(20 * time.Millisecond)

	write := func(db sqlschema.DB, w *outbox.Writer, id string) {
		tx, err := db.Conn.BeginTx(ctx, nil)
		require.NoError(t, err)
		pub, err := w.Publisher(tx)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("t", message.NewMessage(id, nil)))
		require.NoError(t, tx.Commit())
	}
	firstW, err := outbox.NewWriter(first)
	require.NoError(t, err)
	secondW, err := outbox.NewWriter(second)
	require.NoError(t, err)
	write(first, firstW, "in-the-first-database")
	write(second, secondW, "in-the-second-database")
	waitDelivered(t, rec, 1, 2*time.Second, "a write to the second database right after one to the first")
}
