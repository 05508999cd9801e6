package inboxdb_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// The pgx fast path behind PgBouncer in transaction pooling (issue 8, item
// 8): 32 client connections share 4 server connections, so consecutive
// round trips of one client land on different server sessions. 400
// concurrent claims, 300 distinct keys and a second copy of 100 of them:
// no error, each key claimed once, each second copy recognised and counted.
func TestBeginClaimPgxThroughPgBouncer(t *testing.T) {
	t.Parallel()
	bouncer := testenv.PgBouncer(t, "transaction")
	eachLayout(t, func(t *testing.T, layout string) {
		tables := testenv.SchemaLayout(t, layout)
		store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()

		cfg, err := pgxpool.ParseConfig(bouncer)
		require.NoError(t, err)
		cfg.MaxConns = 32
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		defer pool.Close()

		const distinct, dups = 300, 100
		keys := make([]string, 0, distinct+dups)
		for i := 0; i < distinct; i++ {
			keys = append(keys, fmt.Sprintf("k-%03d", i))
		}
		for i := 0; i < dups; i++ {
			keys = append(keys, fmt.Sprintf("k-%03d", i*3))
		}

		var (
			mu         sync.Mutex
			errs       []error
			claimed    = map[string]int{}
			duplicates = map[string]int{}
			wg         sync.WaitGroup
		)
		for _, key := range keys {
			wg.Go(func() {
				err := func() error {
					conn, err := pool.Acquire(ctx)
					if err != nil {
						return err
					}
					defer conn.Release()
					tx, res, err := store.BeginClaimPgx(ctx, conn.Conn(), "pgbouncer", key)
					if err != nil {
						return err
					}
					if res.Claimed {
						if err := tx.Commit(ctx); err != nil {
							return err
						}
					}
					mu.Lock()
					defer mu.Unlock()
					if res.Claimed {
						claimed[key]++
					} else {
						duplicates[key]++
					}
					return nil
				}()
				if err != nil {
					mu.Lock()
					errs = append(errs, fmt.Errorf("%s: %w", key, err))
					mu.Unlock()
				}
			})
		}
		wg.Wait()

		if len(errs) > 0 {
			t.Errorf("%d of %d claims failed, the first: %v", len(errs), len(keys), errs[0])
		}
		var claimedOnce, claimedTwice int
		for _, n := range claimed {
			if n == 1 {
				claimedOnce++
			} else {
				claimedTwice++
			}
		}
		require.Equal(t, distinct, claimedOnce, "every key claimed once")
		require.Zero(t, claimedTwice, "keys claimed more than once")
		require.Len(t, duplicates, dups, "every second copy recognised as a duplicate")

		direct := testenv.Pool(t)
		var rows, counted int64
		require.NoError(t, direct.QueryRow(ctx, `SELECT count(*), coalesce(sum(duplicates), 0) FROM `+store.Table()).Scan(&rows, &counted))
		require.Equal(t, int64(distinct), rows)
		require.Equal(t, int64(dups), counted, "every duplicate counted")
	})
}

// Purge's exclusivity behind PgBouncer in transaction pooling (4 server
// connections shared): the purge lock is transaction-scoped, so it holds
// whichever server connection a batch runs on. A purge meets a lock held
// by another session; two purges race; on the partitioned layout a purge
// drops a past partition (DETACH CONCURRENTLY is one statement outside a
// transaction, which transaction pooling runs as is).
func TestPurgeThroughPgBouncer(t *testing.T) {
	t.Parallel()
	bouncer := testenv.PgBouncer(t, "transaction")
	eachLayout(t, func(t *testing.T, layout string) {
		tables := testenv.SchemaLayout(t, layout)
		store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		cfg, err := pgxpool.ParseConfig(bouncer)
		require.NoError(t, err)
		cfg.MaxConns = 8
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		defer pool.Close()
		db := wsql.BeginnerFromPgx(pool)
		direct := testenv.Pool(t)
		b := bundle{ctx: ctx, db: db, tables: tables, store: store}

		b.exec(t, "INSERT INTO "+store.Table()+` (consumer, message_key, first_seen_at, processed_at)
SELECT 'c', 'k-' || g, now() - interval '2 days', now() - interval '2 days' FROM generate_series(1, 2000) g`)
		opts := inboxdb.PurgeOptions{OlderThan: time.Hour, Consumer: "c", BatchSize: 50}

		held, err := direct.Begin(ctx)
		require.NoError(t, err)
		_, err = held.Exec(ctx, "SELECT pg_advisory_xact_lock(x'656f7075'::int, hashtext($1))", store.Table())
		require.NoError(t, err)
		n, err := store.Purge(ctx, db, opts)
		require.ErrorIs(t, err, inboxdb.ErrPurgeRunning)
		require.Zero(t, n)
		require.NoError(t, held.Rollback(ctx))

		var wg sync.WaitGroup
		var total [2]int64
		var errs [2]error
		for i := range 2 {
			wg.Go(func() {
				for {
					n, err := store.Purge(ctx, db, opts)
					total[i] += n
					if !errors.Is(err, inboxdb.ErrPurgeRunning) {
						errs[i] = err
						return
					}
				}
			})
		}
		wg.Wait()
		require.NoError(t, errors.Join(errs[:]...))
		require.Equal(t, int64(2000), total[0]+total[1])
		require.Zero(t, b.count(t, ""))

		if layout == "partitioned" {
			from := b.addPastPartition(t, 3)
			b.exec(t, "INSERT INTO "+store.Table()+` (consumer, message_key, status, first_seen_at, processed_at, partition_at)
SELECT 'c', 'old-' || g, CASE WHEN g = 1 THEN 'parked' ELSE 'done' END, $1::timestamptz, $1::timestamptz, $1::timestamptz FROM generate_series(1, 500) g`, from)
			var dropped []int64
			n, err := store.Purge(ctx, db, inboxdb.PurgeOptions{OlderThan: 24 * time.Hour, Progress: func(d int64) { dropped = append(dropped, d) }})
			require.NoError(t, err)
			require.Equal(t, int64(499), n)
			require.Equal(t, []int64{499}, dropped)
			require.Equal(t, int64(1), b.count(t, "message_key = 'old-1' AND status = 'parked'"))
		}
	})
}
