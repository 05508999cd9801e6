package inboxdb_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

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
