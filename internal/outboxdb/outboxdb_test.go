package outboxdb_test

import (
	"context"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// Every statement renders for a table set, and PostgreSQL accepts it:
// PREPARE parses, resolves every table, column and function and infers
// every parameter's type, so a typo in a .sql file fails here, not in the
// test of the one path that runs it.
func TestStatementsPrepare(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db := testenv.Schema(t)
	s, err := outboxdb.New(db)
	require.NoError(t, err)
	all := s.Statements()
	require.GreaterOrEqual(t, len(all), 35)
	conn, err := pgx.Connect(ctx, testenv.DirectDatabaseURL())
	require.NoError(t, err)
	defer func() { _ = conn.Close(context.Background()) }()
	for i, st := range all {
		name, q := st.Name, st.SQL
		require.NotContains(t, q, "{{", "%s: rendered", name)
		if name == "Listen" {
			// A utility statement: PREPARE does not take it. Run it.
			_, err := conn.Exec(ctx, q)
			require.NoError(t, err, "%s:\n%s", name, q)
			continue
		}
		_, err := conn.Exec(ctx, "PREPARE outboxdb_"+strconv.Itoa(i)+" AS "+q)
		require.NoError(t, err, "%s:\n%s", name, q)
	}
}

// The statements name no other table than the table set's, and say so
// once: a statement rendered for one schema never reaches another's.
func TestStatementsName(t *testing.T) {
	t.Parallel()
	db := testenv.Schema(t)
	db.Conn = nil
	s, err := outboxdb.New(db)
	require.NoError(t, err)
	byName := map[string]string{}
	for _, st := range s.Statements() {
		name, q := st.Name, st.SQL
		byName[name] = q
		if strings.Contains(q, `"watermill_outbox"`) {
			require.Contains(t, q, db.Outbox(), name)
		}
	}
	require.Contains(t, byName["Notify"], "'"+outboxnotify.Channel(db)+"'")
	require.Contains(t, byName["LockListener"], strconv.Itoa(outboxnotify.ListenerLockClass))
}

// The lock a relay's LISTEN session takes is the one Relays finds, as
// pg_locks shows a one-bigint advisory key: classid ListenerLockClass
// (which checks the SQL's spelling of it), objid the table's oid, objsubid
// 1. It is shared (two sessions hold it at once), lasts as long as the
// session, and a missing table takes nothing.
func TestListenerLock(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	db := testenv.Schema(t)
	s, err := outboxdb.New(db)
	require.NoError(t, err)
	conn := func() *pgx.Conn {
		c, err := pgx.Connect(ctx, testenv.DirectDatabaseURL())
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		return c
	}
	c1, c2, observer := conn(), conn(), conn()
	// look returns the sessions pg_locks shows holding the lock, and those
	// Relays finds listening. The two are read one after the other: while
	// a session ends, one may still show it and the other not.
	look := func() (pids, listening []uint32) {
		rows, err := observer.Query(ctx, `SELECT l.pid FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted AND l.classid = $1::oid
AND l.objid = $2::regclass::oid AND l.objsubid = 1 ORDER BY l.pid`, uint32(outboxnotify.ListenerLockClass), db.Outbox())
		require.NoError(t, err)
		pids, err = pgx.CollectRows(rows, pgx.RowTo[uint32])
		require.NoError(t, err)
		sessions, err := s.Relays(ctx, db.Conn)
		require.NoError(t, err)
		for _, r := range sessions {
			if r.Listening {
				listening = append(listening, uint32(r.PID))
			}
		}
		slices.Sort(listening)
		return pids, listening
	}
	// holders is look's sessions, once no session is ending: Relays finds
	// the same sessions, as listening.
	holders := func() []uint32 {
		pids, listening := look()
		require.ElementsMatch(t, pids, listening)
		return pids
	}
	require.Empty(t, holders())
	for _, c := range []*pgx.Conn{c1, c2} {
		held, err := s.LockListener(ctx, c)
		require.NoError(t, err)
		require.True(t, held)
	}
	want := []uint32{c1.PgConn().PID(), c2.PgConn().PID()}
	if want[0] > want[1] {
		want[0], want[1] = want[1], want[0]
	}
	require.Equal(t, want, holders(), "both sessions hold it (shared)")

	require.NoError(t, c1.Close(ctx))
	require.Eventually(t, func() bool {
		pids, listening := look()
		return len(pids) == 1 && slices.Equal(pids, listening)
	}, 10*time.Second, 20*time.Millisecond, "the lock goes with its session, and Relays stops finding it")
	require.Equal(t, []uint32{c2.PgConn().PID()}, holders(), "the other session keeps it")

	missing := db
	missing.OutboxTable = "no_such_table"
	ms, err := outboxdb.New(missing)
	require.NoError(t, err)
	held, err := ms.LockListener(ctx, c2)
	require.NoError(t, err)
	require.False(t, held, "no table, no lock")
}
