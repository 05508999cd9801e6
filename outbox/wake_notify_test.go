package outbox_test

import (
	"context"
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

// listenFor opens a direct connection that LISTENs on the channel of
// tables' outbox.
func listenFor(t *testing.T, ctx context.Context, tables sqlschema.DB) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, testenv.DirectDatabaseURL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{outbox.ChannelName(tables)}.Sanitize())
	require.NoError(t, err)
	return conn
}

// notified reports whether conn receives a notification within d.
func notified(conn *pgx.Conn, d time.Duration) bool {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	_, err := conn.WaitForNotification(ctx)
	return err == nil
}

// A Publish whose INSERT fails sent no NOTIFY (its statement failed): it
// must not count as the one NOTIFY of the debounce interval, neither for
// the other writers of the process nor for a later Publish of the same
// Publisher (after ROLLBACK TO SAVEPOINT, the transaction goes on).
func TestPublishFailedInsertSendsNoNotifyButKeepsNone(t *testing.T) {
	tables := testenv.Schema(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b := newBundle(t, ctx, testenv.Drivers(t)[0].DB, tables)
	listener := listenFor(t, ctx, tables)

	failing := func(t *testing.T) (wsql.Tx, *outbox.Publisher) {
		tx := b.begin(t)
		_, err := tx.ExecContext(ctx, "SAVEPOINT s")
		require.NoError(t, err)
		pub, err := b.w.Publisher(tx)
		require.NoError(t, err)
		cancelled, cancelNow := context.WithCancel(ctx)
		cancelNow()
		m := message.NewMessage("failed", nil)
		m.SetContext(cancelled)
		require.Error(t, pub.Publish("t", m))
		_, err = tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT s")
		require.NoError(t, err)
		return tx, pub
	}

	t.Run("another writer", func(t *testing.T) {
		time.Sleep(20 * time.Millisecond) // past any earlier NOTIFY's debounce
		failing(t)
		b.publish(t, "t", message.NewMessage("other", nil))
		require.True(t, notified(listener, time.Second), "the other writer's commit sent no NOTIFY")
	})
	t.Run("same publisher", func(t *testing.T) {
		time.Sleep(20 * time.Millisecond)
		tx, pub := failing(t)
		time.Sleep(20 * time.Millisecond)
		require.NoError(t, pub.Publish("t", message.NewMessage("retried", nil)))
		require.NoError(t, tx.Commit())
		require.True(t, notified(listener, time.Second), "the retried write's commit sent no NOTIFY")
	})
	t.Run("savepoint rolled back", func(t *testing.T) {
		// The INSERT succeeded with its NOTIFY, and a ROLLBACK TO
		// SAVEPOINT discarded both: the next write of the transaction
		// sends it again.
		time.Sleep(20 * time.Millisecond)
		tx := b.begin(t)
		_, err := tx.ExecContext(ctx, "SAVEPOINT s")
		require.NoError(t, err)
		pub, err := b.w.Publisher(tx)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("t", message.NewMessage("undone", nil)))
		_, err = tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT s")
		require.NoError(t, err)
		time.Sleep(20 * time.Millisecond)
		require.NoError(t, pub.Publish("t", message.NewMessage("kept", nil)))
		require.NoError(t, tx.Commit())
		require.True(t, notified(listener, time.Second), "the kept write's commit sent no NOTIFY")
	})
}
