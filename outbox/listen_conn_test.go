package outbox_test

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// On database/sql the relay's LISTEN connection is a new pgx connection
// with the configuration of one of the pool's. That configuration carries
// the pooled connection's notification handler: kept, the LISTEN
// connection's notifications went to the pooled one (piling up there,
// unread, and written by every relay of the pool at once: a data race seen
// in CI), and its own WaitForNotification returned none.
func TestListenConnOnDatabaseSQLGetsItsOwnNotifications(t *testing.T) {
	t.Parallel()
	// PostgreSQL itself: through PgBouncer (the suite's other run) a
	// LISTEN does not hold, and the relay does not LISTEN there.
	std := testenv.StdDBFor(t, testenv.DirectDatabaseURL())
	tables := testenv.WithConn(testenv.Schema(t), wsql.BeginnerFromStdSQL(std))
	r, err := outbox.NewRelay(outbox.RelayConfig{DB: tables, Publisher: nopPublisher{}, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	channel := testenv.Unique(t, "eo_ch_")
	got, err := outbox.ListenConnReceives(ctx, r, channel, func() error {
		_, err := std.ExecContext(ctx, "SELECT pg_notify($1, '')", channel)
		return err
	})
	require.NoError(t, err)
	require.True(t, got, "the LISTEN connection's own WaitForNotification returns the NOTIFY")
}
