package outbox_test

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// A database/sql pool sized to what the relay's own work needs (one open
// connection per worker) still relays: wake-on-commit's LISTEN connection
// is not one of the pool's, so it cannot starve the batches (or the
// application's other users of the pool).
func TestRelayListenDoesNotTakeAPoolConnection(t *testing.T) {
	tables := testenv.Schema(t)
	// Directly to PostgreSQL even in the suite's run through PgBouncer:
	// what is tested is the database/sql pool's LISTEN connection, which a
	// pooler would turn off.
	db := testenv.StdDBFor(t, testenv.DirectDatabaseURL())
	db.SetMaxOpenConns(1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b := newBundle(t, ctx, wsql.BeginnerFromStdSQL(db), tables)

	rec := &recorder{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, PollInterval: 50 * time.Millisecond, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	runRelay(t, relay)
	waitListening(t, relay)

	// Written through another pool: the relay's is the one under test.
	pb := newBundle(t, ctx, testenv.Drivers(t)[0].DB, tables)
	pb.publish(t, "t", message.NewMessage("m1", nil))
	waitDelivered(t, rec, 1, 3*time.Second, "a relay whose database/sql pool has one connection")
	_ = db
}

// The same with a pgx pool of one connection: the LISTEN connection is
// taken out of the pool (hijacked), which then opens another for the
// batches, so a relay given a one-connection pool still relays, at commit.
func TestRelayListenWithAOneConnectionPgxPool(t *testing.T) {
	tables := testenv.Schema(t)
	cfg, err := pgxpool.ParseConfig(testenv.DirectDatabaseURL())
	require.NoError(t, err)
	cfg.MaxConns = 1
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	b := newBundle(t, ctx, wsql.BeginnerFromPgx(pool), tables)

	rec := &recorder{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, PollInterval: slowPoll, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	stop := runRelay(t, relay)
	defer stop()
	waitListening(t, relay)

	pb := newBundle(t, ctx, testenv.Drivers(t)[0].DB, tables)
	for i := range 3 {
		pb.publish(t, "t", message.NewMessage("m"+string(rune('1'+i)), nil))
		waitDelivered(t, rec, i+1, 3*time.Second, "a relay whose pgx pool has one connection")
	}
}
