package outboxwrite_test

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxwrite"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// A Publisher made by AtCommit writes its rows without a NOTIFY; its
// BeforeCommit sends the one NOTIFY, in the transaction, when a write
// succeeded, and nothing without a write. A Publisher of the same Writer
// made by Publisher sends it with its INSERT.
func TestAtCommitNotifiesBeforeCommit(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tables := testenv.Schema(t)
	listener, err := pgx.Connect(ctx, testenv.DirectDatabaseURL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = listener.Close(context.Background()) })
	_, err = listener.Exec(ctx, "LISTEN "+pgx.Identifier{outboxnotify.Channel(tables)}.Sanitize())
	require.NoError(t, err)
	notified := func() bool {
		wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		defer cancel()
		_, err := listener.WaitForNotification(wctx)
		return err == nil
	}
	w, err := outboxwrite.New(tables)
	require.NoError(t, err)

	for _, c := range []struct {
		name         string
		atCommit     bool
		write        bool
		beforeCommit bool
		want         bool
	}{
		{"at commit, no BeforeCommit", true, true, false, false},
		{"at commit, BeforeCommit", true, true, true, true},
		{"at commit, nothing written", true, false, true, false},
		{"at the INSERT", false, true, false, true},
	} {
		time.Sleep(2 * outboxwrite.NotifyDebounce) // past the previous one's debounce
		tx, err := tables.Conn.BeginTx(ctx, nil)
		require.NoError(t, err)
		p := w.Publisher(tx)
		if c.atCommit {
			p = w.AtCommit(tx)
		}
		if c.write {
			require.NoError(t, p.Publish("t", message.NewMessage(c.name, nil)))
		}
		if c.beforeCommit {
			require.NoError(t, p.BeforeCommit(ctx))
		}
		require.NoError(t, tx.Commit())
		require.Equal(t, c.want, notified(), c.name)
	}
}
