package outboxnotify_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// The lock a relay's LISTEN session takes is the one ListenerLockHeld finds,
// as pg_locks shows a one-bigint advisory key: classid ListenerLockClass
// (which checks the SQL's spelling of it), objid the table's oid, objsubid
// 1. It is shared (two sessions hold it at once),
// lasts as long as the session, and a missing table takes nothing.
func TestListenerLock(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db := testenv.Schema(t)
	conn := func() *pgx.Conn {
		c, err := pgx.Connect(ctx, testenv.DirectDatabaseURL())
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		return c
	}
	c1, c2, observer := conn(), conn(), conn()
	holders := func() []uint32 {
		rows, err := observer.Query(ctx, `SELECT l.pid FROM pg_locks l WHERE `+outboxnotify.ListenerLockHeld+` AND l.classid = $2::oid
AND l.objid = $3::regclass::oid AND l.objsubid = 1 ORDER BY l.pid`, db.Outbox(), uint32(outboxnotify.ListenerLockClass), db.Outbox())
		require.NoError(t, err)
		pids, err := pgx.CollectRows(rows, pgx.RowTo[uint32])
		require.NoError(t, err)
		return pids
	}
	require.Empty(t, holders())
	for _, c := range []*pgx.Conn{c1, c2} {
		var held *bool
		require.NoError(t, c.QueryRow(ctx, outboxnotify.LockListenerSQL, db.Outbox()).Scan(&held))
		require.NotNil(t, held)
		require.True(t, *held)
	}
	want := []uint32{c1.PgConn().PID(), c2.PgConn().PID()}
	if want[0] > want[1] {
		want[0], want[1] = want[1], want[0]
	}
	require.Equal(t, want, holders(), "both sessions hold it (shared)")

	require.NoError(t, c1.Close(ctx))
	require.Eventually(t, func() bool { return len(holders()) == 1 }, 10*time.Second, 20*time.Millisecond, "the lock goes with its session")

	var held *bool
	missing := strings.Replace(db.Outbox(), "watermill_outbox", "no_such_table", 1)
	require.NoError(t, c2.QueryRow(ctx, outboxnotify.LockListenerSQL, missing).Scan(&held))
	require.Nil(t, held, "no table, no lock")
}
