package outboxwrite_test

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
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

// keyedMsg is a message of ordering key key ("" for none).
func keyedMsg(uuid, key string) *message.Message {
	m := message.NewMessage(uuid, nil)
	if key != "" {
		m.Metadata.Set(msgid.OrderingKeyMetadata, key)
	}
	return m
}

// idsOf returns the outbox rows' ids by UUID, as q sees them.
func idsOf(t *testing.T, ctx context.Context, q wsql.ContextExecutor, outbox string) map[string]int64 {
	t.Helper()
	rows, err := q.QueryContext(ctx, "SELECT uuid, id FROM "+outbox)
	require.NoError(t, err)
	out := map[string]int64{}
	for rows.Next() {
		var u string
		var id int64
		require.NoError(t, rows.Scan(&u, &id))
		out[u] = id
	}
	require.NoError(t, rows.Close())
	return out
}

// A writer of key K waits at its Publish while another open transaction
// has written K (on PostgreSQL its advisory lock, on MySQL the key's row
// of the key-lock table), and not for one that wrote a key of another
// lock (L: another bucket, see TestLockBuckets) or no key; it draws its
// row's id once the first commits, so the ids of K follow the commits of
// its writers: a writer whose transaction began first, and which drew an
// id for an unkeyed row before the other took K, still gets the larger id
// for K, having committed second.
func TestWritersOfOneKeyFollowCommitOrder(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		w, err := outboxwrite.New(b.DB)
		require.NoError(t, err)
		publish := func(tx wsql.ContextExecutor, msgs ...*message.Message) error {
			return w.Publisher(tx).Publish("t", msgs...)
		}

		late := b.Begin(t) // begins first, takes K second
		require.NoError(t, publish(late, keyedMsg("late-plain", "")))

		first := b.Begin(t)
		require.NoError(t, publish(first, keyedMsg("first-K", "K")))

		// Another key's writer and an unkeyed one do not wait for K.
		other := b.Begin(t)
		require.NoError(t, publish(other, keyedMsg("other-L", "L"), keyedMsg("other-plain", "")))
		require.NoError(t, other.Commit())

		done := make(chan error, 1)
		go func() { done <- publish(late, keyedMsg("late-K", "K")) }()
		select {
		case err := <-done:
			t.Fatalf("the second writer of K did not wait for the open transaction that wrote K: %v", err)
		case <-time.After(300 * time.Millisecond):
		}
		require.NoError(t, first.Commit())
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(10 * time.Second):
			t.Fatal("the second writer of K still waits after the first committed")
		}
		require.NoError(t, late.Commit())

		ids := idsOf(t, b.Ctx, b.Driver.DB, b.DB.Outbox())
		require.Len(t, ids, 5)
		require.Less(t, ids["late-plain"], ids["first-K"], "late's unkeyed row was drawn first")
		require.Less(t, ids["first-K"], ids["late-K"], "K's ids follow its writers' commits")
		require.Less(t, ids["other-L"], ids["late-K"], "late-K was drawn after first committed")
	})
}

// Concurrent writers, each of a few keys in random order (and the same
// key more than once), never deadlock on the keys' locks (taken in one
// order), and each key's ids follow the order in which its writers held
// its lock: the order they record, holding it, between their Publish and
// their commit.
func TestConcurrentWritersKeepEachKeysOrder(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		w, err := outboxwrite.New(b.DB)
		require.NoError(t, err)
		const writers, txs, keys = 8, 25, 6
		var mu sync.Mutex
		held := map[string][]string{} // key -> UUIDs, in the order their writers held the key
		errs := make(chan error, writers)
		var wg sync.WaitGroup
		for g := range writers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				rng := mrand.New(mrand.NewPCG(uint64(g), 7))
				for i := range txs {
					var msgs []*message.Message
					for j := range 1 + rng.IntN(4) {
						key := fmt.Sprintf("key-%d", rng.IntN(keys))
						msgs = append(msgs, keyedMsg(fmt.Sprintf("w%d-t%d-m%d", g, i, j), key))
					}
					tx, err := b.Driver.DB.BeginTx(b.Ctx, nil)
					if err != nil {
						errs <- err
						return
					}
					if err := w.Publisher(tx).Publish("t", msgs...); err != nil {
						_ = tx.Rollback()
						errs <- err
						return
					}
					mu.Lock()
					for _, m := range msgs {
						k := m.Metadata.Get(msgid.OrderingKeyMetadata)
						held[k] = append(held[k], m.UUID)
					}
					mu.Unlock()
					if err := tx.Commit(); err != nil {
						errs <- err
						return
					}
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err, "a writer failed (a deadlock?)")
		}
		ids := idsOf(t, b.Ctx, b.Driver.DB, b.DB.Outbox())
		for k, uuids := range held {
			byID := slices.Clone(uuids)
			slices.SortStableFunc(byID, func(x, y string) int { return cmp.Compare(ids[x], ids[y]) })
			require.Equal(t, uuids, byID, "key %s: ids in the order its writers held it", k)
		}
	})
}

// Large payloads (MySQL's bound: PostgreSQL has none): a Publish whose
// messages together exceed what one statement may carry on MySQL (max_allowed_packet, 16 MiB by default on
// MariaDB) is split into INSERTs of a few MiB, one transaction outside the
// caller's; every payload is kept byte for byte. On MySQL the writer
// connects with interpolateParams=true, which sends each statement with
// its values as one packet (server-side prepared statements send a large
// value apart, as long data).
func TestPublishLargePayloadsMySQL(t *testing.T) {
	t.Parallel()
	b := testenv.NewBundle(t, testenv.DriverNamed(t, testenv.MariaDB))
	w, err := outboxwrite.New(b.DB)
	require.NoError(t, err)
	const n, size = 5, 4 << 20 // 20 MiB in all
	msgs := make([]*message.Message, n)
	for i := range msgs {
		payload := bytes.Repeat([]byte{byte(i), 0, 0xff, '\''}, size/4)
		msgs[i] = keyedMsg(fmt.Sprintf("big-%d", i), "K")
		msgs[i].Payload = payload
	}
	cfg, err := mysql.ParseDSN(testenv.MySQLDSN(testenv.MySQLURL()))
	require.NoError(t, err)
	cfg.InterpolateParams = true
	conn := wsql.BeginnerFromStdSQL(testenv.MySQLDBFor(t, cfg.FormatDSN()))
	require.NoError(t, w.Publisher(conn).Publish("t", msgs...))
	rows, err := b.Driver.DB.QueryContext(b.Ctx, "SELECT uuid, payload FROM "+b.DB.Outbox()+" ORDER BY id")
	require.NoError(t, err)
	i := 0
	for rows.Next() {
		var u string
		var p []byte
		require.NoError(t, rows.Scan(&u, &p))
		require.Equal(t, msgs[i].UUID, u)
		require.True(t, slices.Equal([]byte(msgs[i].Payload), p), "payload %d kept", i)
		i++
	}
	require.NoError(t, rows.Close())
	require.Equal(t, n, i)
}

// On MySQL, which has no NOTIFY, the writers send none: a Publisher's
// write is its statements only (no key: the INSERT alone), and
// BeforeCommit sends nothing and succeeds.
func TestNoNotifyOnMySQL(t *testing.T) {
	t.Parallel()
	b := testenv.NewBundle(t, testenv.DriverNamed(t, testenv.MariaDB))
	w, err := outboxwrite.New(b.DB)
	require.NoError(t, err)
	tx := b.Begin(t)
	c := &counting{ContextExecutor: tx, texts: map[string]int{}}
	require.NoError(t, w.Publisher(c).Publish("t", keyedMsg("a", "")))
	require.Equal(t, 1, c.n, "the INSERT, no NOTIFY")
	at := w.AtCommit(c)
	require.NoError(t, at.Publish("t", keyedMsg("b", "")))
	require.NoError(t, at.BeforeCommit(b.Ctx))
	require.Equal(t, 2, c.n, "BeforeCommit sends nothing")
	require.NoError(t, tx.Commit())
	require.Equal(t, int64(2), testenv.Count(t, b.Driver.DB, "SELECT count(*) FROM "+b.DB.Outbox()))
}
