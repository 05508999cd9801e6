package outboxwrite_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxwrite"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
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

// counting counts the statements sent through it, by text.
type counting struct {
	wsql.ContextExecutor
	texts map[string]int
	n     int
}

func (c *counting) ExecContext(ctx context.Context, q string, args ...any) (wsql.Result, error) {
	c.n++
	c.texts[q]++
	return c.ContextExecutor.ExecContext(ctx, q, args...)
}

func (c *counting) QueryContext(ctx context.Context, q string, args ...any) (wsql.Rows, error) {
	c.n++
	c.texts[q]++
	return c.ContextExecutor.QueryContext(ctx, q, args...)
}

// A Publish call is one statement whatever its number of messages and
// keys (up to the bound of one INSERT), and the statement is the same
// text for every size: one prepared statement per shape (with or without
// the NOTIFY), not one per batch size. On MySQL, which has no array
// parameters, a call is the multi-row INSERT, after the statement that
// takes its keys' locks when it has keys: two statements, whose texts
// depend on the number of rows. The rows get their ids in the call's
// order, and each keeps its ordering key (NULL without one).
func TestPublishIsOneStatementPerShape(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		publishOneStatementPerShape(t, b)
	})
}

func publishOneStatementPerShape(t *testing.T, b *testenv.Bundle) {
	ctx, tables := b.Ctx, b.DB
	w, err := outboxwrite.New(tables)
	require.NoError(t, err)
	tx, err := tables.Conn.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback() }()
	c := &counting{ContextExecutor: tx, texts: map[string]int{}}
	p := w.AtCommit(c)
	var uuids []string
	for _, size := range []int{1, 3, 250} {
		msgs := make([]*message.Message, size)
		for i := range msgs {
			msgs[i] = message.NewMessage(fmt.Sprintf("m-%d-%d", size, i), []byte("x"))
			if i%2 == 1 {
				msgs[i].Metadata.Set(msgid.OrderingKeyMetadata, fmt.Sprintf("k%d", i%5))
			}
			uuids = append(uuids, msgs[i].UUID)
		}
		before := c.n
		require.NoError(t, p.Publish("t", msgs...))
		want := 1
		if b.MySQL() && size > 1 {
			want = 2 // the keys' locks, then the INSERT
		}
		require.Equal(t, want, c.n-before, "round trips for %d messages", size)
	}
	if b.MySQL() {
		require.Len(t, c.texts, 5, "an INSERT per size, a key-lock statement per number of keys (1: k1; 5: k0 to k4)")
	} else {
		require.Len(t, c.texts, 1, "one statement text for every size")
	}
	rows, err := tx.QueryContext(ctx, "SELECT uuid, coalesce(ordering_key, '<null>') FROM "+tables.Outbox()+" ORDER BY id")
	require.NoError(t, err)
	var got []string
	for rows.Next() {
		var u, k string
		require.NoError(t, rows.Scan(&u, &k))
		got = append(got, u)
		var i int
		_, err := fmt.Sscanf(u[strings.LastIndex(u, "-")+1:], "%d", &i)
		require.NoError(t, err)
		if i%2 == 1 {
			require.Equal(t, fmt.Sprintf("k%d", i%5), k, u)
		} else {
			require.Equal(t, "<null>", k, u)
		}
	}
	require.NoError(t, rows.Close())
	require.Equal(t, uuids, got, "ids follow the call's order")
	require.Equal(t, int64(0), testenv.Count(t, tx, "SELECT count(*) FROM "+tables.Outbox()+" WHERE ordering_key = ''"), "no key is NULL, not ''")
}
