package outbox_test

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
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
	b := bundle{ctx: ctx, db: wsql.BeginnerFromStdSQL(db), tables: tables}

	rec := &recorder{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, PollInterval: 50 * time.Millisecond, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	runRelay(t, relay)
	waitListening(t, relay)

	// Written through another pool: the relay's is the one under test.
	pb := bundle{ctx: ctx, db: testenv.Drivers(t)[0].DB, tables: tables}
	pb.publish(t, "t", message.NewMessage("m1", nil))
	waitDelivered(t, rec, 1, 3*time.Second, "a relay whose database/sql pool has one connection")
	_ = db
}
