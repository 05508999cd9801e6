package inboxdb_test

// The partitioned layout's claim functions (migration inbox_002): they take
// the same per-key lock as the statements they replace and as every other
// writer of records (lease claims, Park, retention's moves), so that claims
// through them and claims through statements, on one instance or two,
// serialise; across partition boundaries, while retention drops a
// partition, and under REPEATABLE READ (refused) as before. A table whose
// functions are missing is claimed by statements.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// claimPath is one way to claim a key: through ClaimTx ("tx"),
// ClaimBatchTx ("batch") or BeginClaimPgx ("pgx"), with or without the
// claim functions.
type claimPath struct {
	kind  string
	funcs bool
}

func (p claimPath) String() string {
	if p.funcs {
		return p.kind + "/function"
	}
	return p.kind + "/statements"
}

var claimPaths = []claimPath{{"tx", true}, {"batch", true}, {"pgx", true}, {"tx", false}, {"batch", false}, {"pgx", false}}

// storeFor returns a store of b's table (another instance) that claims
// through p.
func (b bundle) storeFor(t *testing.T, p claimPath) *inboxdb.Store {
	t.Helper()
	s, err := inboxdb.NewStore(inboxdb.Config{Tables: b.tables})
	require.NoError(t, err)
	s.UseClaimFunctions(p.funcs)
	return s
}

// openClaim is a claim whose transaction is open (when it claimed).
type openClaim struct {
	res inboxdb.ClaimResult
	pid int // the backend of its transaction
	end func(commit bool) error
}

// claimOpen claims (consumer, key) through p with store, and leaves its
// transaction open when it claimed (ended at cleanup otherwise).
func (b bundle) claimOpen(ctx context.Context, pool *pgxpool.Pool, store *inboxdb.Store, p claimPath, consumer, key string) (openClaim, error) {
	c, err := b.claimOpenOnce(ctx, pool, store, p, consumer, key)
	if c.end != nil {
		var once sync.Once
		end := c.end
		c.end = func(commit bool) (err error) {
			once.Do(func() { err = end(commit) })
			return err
		}
	}
	return c, err
}

func (b bundle) claimOpenOnce(ctx context.Context, pool *pgxpool.Pool, store *inboxdb.Store, p claimPath, consumer, key string) (openClaim, error) {
	switch p.kind {
	case "pgx":
		conn, err := pool.Acquire(ctx)
		if err != nil {
			return openClaim{}, err
		}
		tx, res, err := store.BeginClaimPgx(ctx, conn.Conn(), consumer, key)
		if err != nil || tx == nil {
			conn.Release()
			return openClaim{res: res, end: func(bool) error { return nil }}, err
		}
		// The server's pid, asked in the transaction (through PgBouncer the
		// connection's own is PgBouncer's).
		var pid int
		if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			_ = tx.Rollback(ctx)
			conn.Release()
			return openClaim{}, err
		}
		return openClaim{res: res, pid: pid, end: func(commit bool) error {
			defer conn.Release()
			if commit {
				return tx.Commit(ctx)
			}
			return tx.Rollback(ctx)
		}}, nil
	default:
		tx, err := b.db.BeginTx(ctx, nil)
		if err != nil {
			return openClaim{}, err
		}
		var pid int
		if err := seam.QueryRow(ctx, tx, "SELECT pg_backend_pid()", nil, &pid); err != nil {
			_ = tx.Rollback()
			return openClaim{}, err
		}
		var res inboxdb.ClaimResult
		if p.kind == "tx" {
			res, err = store.ClaimTx(ctx, tx, consumer, key)
		} else {
			var results []inboxdb.ClaimResult
			var errs []error
			results, errs, err = store.ClaimBatchTx(ctx, tx, consumer, []string{key})
			if err == nil {
				res, err = results[0], errs[0]
			}
		}
		if err != nil {
			_ = tx.Rollback()
			return openClaim{res: res, pid: pid, end: func(bool) error { return nil }}, err
		}
		return openClaim{res: res, pid: pid, end: func(commit bool) error {
			if commit {
				return tx.Commit()
			}
			return tx.Rollback()
		}}, nil
	}
}

// Every pair of claim paths, one holding an uncommitted claim of a key and
// the other claiming it meanwhile (another instance), a path with the
// functions against one without and against itself: the second waits for
// the first, then sees its record (committed: a duplicate) or claims the
// key (rolled back). The key's first record lives in yesterday's partition
// for half the keys ("old-"): the second is a duplicate whatever the
// first did. Were the function's lock key not the statements' (or were
// there no lock), the second would not wait, and the test fails at
// awaitBlocked.
func TestPartitionedClaimFunctionsSerialise(t *testing.T) {
	t.Parallel()
	eachDriverPartitioned(t, func(t *testing.T, b bundle) {
		yesterday := b.addPastPartition(t, 1)
		pool := testenv.Pool(t) // the pgx path's, whatever b's driver
		n := 0
		for _, first := range claimPaths {
			for _, second := range claimPaths {
				if !first.funcs && !second.funcs {
					continue // the statements against themselves: partition_test.go
				}
				s1, s2 := b.storeFor(t, first), b.storeFor(t, second)
				for _, commit := range []bool{true, false} {
					for _, old := range []bool{false, true} {
						n++
						key := fmt.Sprintf("k%d-%v-%v-%v", n, first, second, commit)
						if old {
							key = "old-" + key
							b.exec(t, "INSERT INTO "+b.store.Table()+` (consumer, message_key, status, processed_at, partition_at)
VALUES ('c', $1, 'done', $2::timestamptz, $2::timestamptz)`, key, yesterday.Add(time.Hour))
						}
						// The first: an open claim, or (old key) an open
						// transaction that counted the duplicate under the key's
						// lock, which a claim holds until it ends.
						c1, err := b.claimOpen(b.ctx, pool, s1, first, "c", key)
						require.NoError(t, err, key)
						t.Cleanup(func() { _ = c1.end(false) }) // a failure before it ends
						require.Equal(t, !old, c1.res.Claimed, key)
						if old {
							// The first counted the duplicate: the second is one too.
							require.NoError(t, c1.end(commit))
							c2, err := b.claimOpen(b.ctx, pool, s2, second, "c", key)
							require.NoError(t, err, key)
							require.False(t, c2.res.Claimed, "%s: recorded yesterday", key)
							require.NoError(t, c2.end(true))
							dups := int64(1)
							if commit || first.kind == "pgx" { // the pgx path commits the count itself
								dups = 2
							}
							require.Equal(t, dups, testenv.Count(t, b.db, "SELECT duplicates FROM "+b.store.Table()+" WHERE message_key = $1", key))
							require.Equal(t, int64(1), b.count(t, "message_key = $1", key))
							continue
						}
						type outcome struct {
							c   openClaim
							err error
						}
						done := make(chan outcome, 1)
						go func() {
							c, err := b.claimOpen(b.ctx, pool, s2, second, "c", key)
							done <- outcome{c, err}
						}()
						t.Cleanup(func() { // a failure before it ends
							_ = c1.end(false)
							if o := <-done; o.c.end != nil {
								_ = o.c.end(false)
							}
						})
						b.awaitBlocked(t, c1.pid, fmt.Sprintf("%s waits for %s's claim of %s", second, first, key))
						select {
						case <-done:
							t.Fatalf("%s returned while %s held the key", second, first)
						default:
						}
						require.NoError(t, c1.end(commit))
						o := <-done
						done <- o // for the cleanup
						require.NoError(t, o.err, key)
						require.Equal(t, !commit, o.c.res.Claimed, "%s after %s (commit %v)", second, first, commit)
						require.NoError(t, o.c.end(true))
						require.Equal(t, int64(1), b.count(t, "message_key = $1", key), key)
					}
				}
			}
		}
	})
}

// Copies of keys claimed at once through every path (both drivers' claims,
// the pgx fast path, group commit; with and without the functions: two
// instances) while Store.Purge drops the partition of three days ago:
// new keys are claimed once; keys recorded yesterday, and keys whose
// records the purge moves out of the dropped partition (parked, or done
// recently) are never claimed again, during the move and after it.
func TestPartitionedClaimFunctionsRaceDuringDrop(t *testing.T) {
	t.Parallel()
	eachDriverPartitioned(t, func(t *testing.T, b bundle) {
		pool := testenv.Pool(t)
		yesterday := b.addPastPartition(t, 1)
		old := b.addPastPartition(t, 3)
		const n = 12
		table := b.store.Table()
		for i := range n {
			b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, processed_at, partition_at)
VALUES ('c', $1, 'done', $2::timestamptz, $2::timestamptz)`, fmt.Sprintf("yesterday-%d", i), yesterday.Add(time.Hour))
			b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, processed_at, partition_at)
VALUES ('c', $1, 'parked', $2::timestamptz, $2::timestamptz)`, fmt.Sprintf("parked-%d", i), old.Add(time.Hour))
			b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, processed_at, partition_at)
VALUES ('c', $1, 'done', now() - interval '1 minute', $2::timestamptz)`, fmt.Sprintf("recent-%d", i), old.Add(time.Hour))
			b.exec(t, "INSERT INTO "+table+` (consumer, message_key, status, processed_at, partition_at)
VALUES ('c', $1, 'done', $2::timestamptz, $2::timestamptz)`, fmt.Sprintf("expired-%d", i), old.Add(time.Hour))
		}
		stores := map[bool]*inboxdb.Store{true: b.storeFor(t, claimPath{funcs: true}), false: b.storeFor(t, claimPath{funcs: false})}

		var keys []string
		for i := range n {
			keys = append(keys, fmt.Sprintf("new-%d", i), fmt.Sprintf("yesterday-%d", i), fmt.Sprintf("parked-%d", i), fmt.Sprintf("recent-%d", i))
		}
		type result struct {
			key     string
			claimed bool
			err     error
		}
		results := make(chan result, len(keys)*len(claimPaths)*2)
		purged := make(chan error, 1)
		start := make(chan struct{})
		go func() {
			<-start
			_, err := b.store.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: 36 * time.Hour, BatchSize: 3})
			purged <- err
		}()
		var wg sync.WaitGroup
		for round := range 2 {
			for _, k := range keys {
				for _, p := range claimPaths {
					wg.Go(func() {
						<-start
						if round == 1 {
							time.Sleep(time.Duration(rand.IntN(50)) * time.Millisecond)
						}
						c, err := b.claimOpen(b.ctx, pool, stores[p.funcs], p, "c", k)
						if err == nil {
							err = c.end(true)
						}
						results <- result{k, c.res.Claimed, err}
					})
				}
			}
		}
		close(start)
		wg.Wait()
		require.NoError(t, <-purged)
		close(results)
		claimed := map[string]int{}
		for r := range results {
			require.NoError(t, r.err, r.key)
			if r.claimed {
				claimed[r.key]++
			}
		}
		for _, k := range keys {
			want := 0
			if strings.HasPrefix(k, "new-") {
				want = 1
			}
			require.Equal(t, want, claimed[k], "claims of %s", k)
			require.Equal(t, int64(1), b.count(t, "message_key = $1", k), "records of %s", k)
		}
		require.Equal(t, []string{"gone"}, b.strings(t, "SELECT coalesce(to_regclass($1)::text, 'gone')", b.layout().Quoted(b.layout().Name(old))),
			"the partition of three days ago was dropped")
		require.Zero(t, b.count(t, "message_key LIKE 'expired-%'"), "its expired records with it")
	})
}

// A table whose claim functions are missing (not migrated to inbox_002
// yet, or dropped since a store found them) is claimed by statements: a
// store that finds them missing uses its statements; one that believed
// them present retries the pgx fast path by statements, and fails ClaimTx
// and ClaimBatchTx with ErrPartitionsChanged (claim again in a new
// transaction, as the middleware does), after which it claims by
// statements. Migrate creates them again.
func TestPartitionedClaimWithoutFunctions(t *testing.T) {
	t.Parallel()
	eachDriverPartitioned(t, func(t *testing.T, b bundle) {
		pool := testenv.Pool(t)
		believer := b.storeFor(t, claimPath{funcs: true})
		c, err := b.claimOpen(b.ctx, pool, believer, claimPath{kind: "tx", funcs: true}, "c", "warm-up")
		require.NoError(t, err)
		require.NoError(t, c.end(true))
		require.True(t, c.res.Claimed)

		fn := func(suffix string) string {
			return pgx.Identifier{b.tables.Schema, b.tables.InboxTable + "_" + suffix}.Sanitize()
		}
		b.exec(t, "DROP FUNCTION "+fn("claim")+"(text, text, boolean), "+fn("claim_batch")+"(text, text[]), "+fn("duplicate")+"(text, text)")

		c, err = b.claimOpen(b.ctx, pool, believer, claimPath{kind: "tx", funcs: true}, "c", "k-tx")
		require.ErrorIs(t, err, inboxdb.ErrPartitionsChanged)
		require.False(t, c.res.Claimed)
		for _, p := range []claimPath{{"tx", true}, {"batch", true}, {"pgx", true}} {
			for _, s := range []*inboxdb.Store{believer, b.storeFor(t, p)} {
				k := "k-" + p.kind
				c, err := b.claimOpen(b.ctx, pool, s, p, "c", k)
				require.NoError(t, err, k)
				require.NoError(t, c.end(true))
				require.Equal(t, s == believer, c.res.Claimed, k)
			}
		}
		require.NoError(t, sqlschema.Migrate(b.ctx, b.tables))
		fresh := b.storeFor(t, claimPath{funcs: true})
		c, err = b.claimOpen(b.ctx, pool, fresh, claimPath{kind: "pgx", funcs: true}, "c", "k-pgx")
		require.NoError(t, err)
		require.False(t, c.res.Claimed)
		require.Equal(t, int64(2), testenv.Count(t, b.db, "SELECT duplicates FROM "+b.store.Table()+" WHERE message_key = 'k-pgx'"))
	})
}
