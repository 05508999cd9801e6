package inboxdb_test

import (
	"context"
	"strings"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

func TestBeginClaimPgx(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, layout string) {
		tables := testenv.SchemaLayout(t, layout)
		pool := testenv.Pool(t)
		store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()

		conn, err := pool.Acquire(ctx)
		require.NoError(t, err)
		defer conn.Release()
		c := conn.Conn()
		idle := func() { require.Equal(t, byte('I'), c.PgConn().TxStatus(), "conn must be left outside a transaction") }

		// Claim, then roll back: nothing recorded, the key can be claimed again.
		tx, res, err := store.BeginClaimPgx(ctx, c, "c1", "k'1") // a quote in the key is data, not SQL
		require.NoError(t, err)
		require.True(t, res.Claimed)
		require.NoError(t, tx.Rollback(ctx))
		_, err = store.Lookup(ctx, wsql.BeginnerFromPgx(pool), "c1", "k'1")
		require.ErrorIs(t, err, inboxdb.ErrNotFound)

		tx, res, err = store.BeginClaimPgx(ctx, c, "c1", "k'1")
		require.NoError(t, err)
		require.True(t, res.Claimed)
		require.NoError(t, tx.Commit(ctx))

		// Duplicate: no tx, the record, the counter incremented, conn idle.
		tx, res, err = store.BeginClaimPgx(ctx, c, "c1", "k'1")
		require.NoError(t, err)
		require.Nil(t, tx)
		require.False(t, res.Claimed)
		require.Equal(t, inboxdb.StatusDone, res.Existing.Status)
		require.Equal(t, int64(1), res.Existing.Duplicates)
		idle()

		// The session keeps a SQL-level prepared statement, the claim's
		// INSERT, only when the connection's exec mode keeps statements in
		// the session anyway (cache_statement, pgx's default): with exec
		// (PgBouncer's transaction pooling, as the suite runs through it)
		// nothing is kept. The partitioned layout never prepares.
		var prepared int
		require.NoError(t, c.QueryRow(ctx, `SELECT count(*) FROM pg_prepared_statements WHERE from_sql`).Scan(&prepared))
		if layout == "plain" && c.Config().DefaultQueryExecMode == pgx.QueryExecModeCacheStatement {
			require.Equal(t, 1, prepared, "SQL-level prepared statements in the session")
		} else {
			require.Zero(t, prepared, "SQL-level prepared statements in the session")
		}
		tx, res, err = store.BeginClaimPgx(ctx, c, "c1", "k2")
		require.NoError(t, err)
		require.True(t, res.Claimed)
		require.NoError(t, tx.Commit(ctx))

		// A lease-mode record in the middle of an attempt is not a duplicate
		// but an error.
		_, err = pool.Exec(ctx, "UPDATE "+tables.Inbox()+" SET status = 'processing', lease_until = now() + interval '1 hour' WHERE message_key = 'k2'")
		require.NoError(t, err)
		tx, res, err = store.BeginClaimPgx(ctx, c, "c1", "k2")
		require.ErrorIs(t, err, inboxdb.ErrNotDone)
		require.Nil(t, tx)
		require.False(t, res.Claimed)
		require.Equal(t, inboxdb.StatusProcessing, res.Existing.Status)
		idle()

		// Invalid keys never reach the database.
		_, _, err = store.BeginClaimPgx(ctx, c, "c1", "")
		require.ErrorIs(t, err, inboxdb.ErrEmptyKey)
	})
}

func TestBeginClaimPgxConcurrent(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, layout string) {
		tables := testenv.SchemaLayout(t, layout)
		pool := testenv.Pool(t)
		store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()

		for _, commitFirst := range []bool{true, false} {
			key := "race-commit"
			if !commitFirst {
				key = "race-rollback"
			}
			c1, err := pool.Acquire(ctx)
			require.NoError(t, err)
			c2, err := pool.Acquire(ctx)
			require.NoError(t, err)
			// Released below; on a failure before that, at cleanup, before the
			// pool's Close, which would wait for them forever.
			t.Cleanup(c1.Release)
			t.Cleanup(c2.Release)

			tx1, res1, err := store.BeginClaimPgx(ctx, c1.Conn(), "c", key)
			require.NoError(t, err)
			require.True(t, res1.Claimed)

			type result struct {
				tx  pgx.Tx
				res inboxdb.ClaimResult
				err error
			}
			second := make(chan result, 1)
			go func() {
				tx, res, err := store.BeginClaimPgx(ctx, c2.Conn(), "c", key)
				second <- result{tx, res, err}
			}()
			// The second claim waits on the first transaction's row lock.
			testenv.Eventually(t, 10*time.Second, func() bool {
				var n int
				// The literal INSERT names the table, the prepared one's EXECUTE
				// the statement (a name per table), the partitioned layout's
				// claim function "<schema>"."<table>_claim" (hence the table's
				// name without its closing quote).
				_ = pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE 'BEGIN; %' AND (strpos(query, $1) > 0 OR strpos(query, $2) > 0)`,
					strings.TrimSuffix(tables.Inbox(), `"`), store.PreparedClaimName()).Scan(&n)
				return n > 0
			}, "the second claim should block on the first")
			select {
			case <-second:
				t.Fatal("the second claim returned before the first transaction ended")
			default:
			}
			if commitFirst {
				require.NoError(t, tx1.Commit(ctx))
			} else {
				require.NoError(t, tx1.Rollback(ctx))
			}
			r := <-second
			require.NoError(t, r.err)
			if commitFirst {
				require.False(t, r.res.Claimed, "committed first claim: the second is a duplicate")
				require.Nil(t, r.tx)
			} else {
				require.True(t, r.res.Claimed, "rolled-back first claim: the second claims")
				require.NoError(t, r.tx.Commit(ctx))
			}
			c1.Release()
			c2.Release()
		}
	})
}
