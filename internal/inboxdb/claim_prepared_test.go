package inboxdb_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// poolWithMode is a pool to dbURL whose connections use the given pgx exec
// mode, closed at cleanup.
func poolWithMode(t *testing.T, dbURL string, mode pgx.QueryExecMode, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dbURL)
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = mode
	cfg.MaxConns = maxConns
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// sessionStatements lists the SQL-level prepared statements of c's session
// (name: statement), and their executions (generic and custom plans).
func sessionStatements(ctx context.Context, t *testing.T, c *pgx.Conn) (map[string]string, int64) {
	t.Helper()
	rows, err := c.Query(ctx, `SELECT name, statement, generic_plans + custom_plans FROM pg_prepared_statements WHERE from_sql`,
		pgx.QueryExecModeSimpleProtocol)
	require.NoError(t, err)
	stmts := map[string]string{}
	var runs int64
	for rows.Next() {
		var name, stmt string
		var n int64
		require.NoError(t, rows.Scan(&name, &stmt, &n))
		stmts[name] = stmt
		runs += n
	}
	require.NoError(t, rows.Err())
	return stmts, runs
}

// claimCommit claims key on c and commits; it fails the test unless the key
// was claimed.
func claimCommit(ctx context.Context, t *testing.T, s *inboxdb.Store, c *pgx.Conn, consumer, key string) {
	t.Helper()
	tx, res, err := s.BeginClaimPgx(ctx, c, consumer, key)
	require.NoError(t, err)
	require.True(t, res.Claimed, key)
	require.NoError(t, tx.Commit(ctx))
}

// On a connection straight to PostgreSQL in pgx's default exec mode
// (cache_statement), the claim is a statement prepared once per session and
// executed by every claim; two stores of one table share it, a store of
// another table has its own; duplicates are counted as with the literal
// INSERT.
func TestBeginClaimPgxPrepared(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tables := testenv.Schema(t)
	other := testenv.Schema(t)
	s1, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
	require.NoError(t, err)
	s2, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
	require.NoError(t, err)
	s3, err := inboxdb.NewStore(inboxdb.Config{Tables: other})
	require.NoError(t, err)
	require.Equal(t, s1.PreparedClaimName(), s2.PreparedClaimName(), "one table, one statement")
	require.NotEqual(t, s1.PreparedClaimName(), s3.PreparedClaimName(), "a statement per table")
	require.True(t, strings.HasPrefix(s1.PreparedClaimName(), "exactlyonce_claim_"), s1.PreparedClaimName())

	pool := poolWithMode(t, testenv.DirectDatabaseURL(), pgx.QueryExecModeCacheStatement, 2)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	c := conn.Conn()

	claimCommit(ctx, t, s1, c, "c", "k'1")
	stmts, runs := sessionStatements(ctx, t, c)
	require.Len(t, stmts, 1)
	require.Contains(t, stmts[s1.PreparedClaimName()], "INSERT INTO "+s1.Table())
	require.Equal(t, int64(1), runs)

	claimCommit(ctx, t, s2, c, "c", "k2")
	tx, res, err := s1.BeginClaimPgx(ctx, c, "c", "k3")
	require.NoError(t, err)
	require.True(t, res.Claimed)
	require.NoError(t, tx.Rollback(ctx))
	stmts, runs = sessionStatements(ctx, t, c)
	require.Len(t, stmts, 1, "the second store of the table uses the first one's statement")
	require.Equal(t, int64(3), runs, "every claim executed it")

	// Duplicate: counted, the record returned, no tx, conn idle.
	tx, res, err = s2.BeginClaimPgx(ctx, c, "c", "k'1")
	require.NoError(t, err)
	require.Nil(t, tx)
	require.False(t, res.Claimed)
	require.Equal(t, inboxdb.StatusDone, res.Existing.Status)
	require.Equal(t, int64(1), res.Existing.Duplicates)
	require.Equal(t, byte('I'), c.PgConn().TxStatus())

	// Another table, another statement in the same session.
	claimCommit(ctx, t, s3, c, "c", "k'1")
	stmts, _ = sessionStatements(ctx, t, c)
	require.Len(t, stmts, 2)
	require.Contains(t, stmts[s3.PreparedClaimName()], "INSERT INTO "+s3.Table())

	var rows, dups int64
	require.NoError(t, c.QueryRow(ctx, `SELECT count(*), sum(duplicates) FROM `+s1.Table()).Scan(&rows, &dups))
	require.Equal(t, int64(2), rows, "k'1 and k2 (k3 rolled back)")
	require.Equal(t, int64(1), dups)
	require.False(t, s1.PreparedClaimOff())
}

// With any exec mode but cache_statement (exec, as behind PgBouncer), or
// with Config.LiteralClaim, the claim keeps nothing in the session.
func TestBeginClaimPgxLiteral(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tables := testenv.Schema(t)
	for _, tc := range []struct {
		name    string
		mode    pgx.QueryExecMode
		literal bool
	}{
		{"exec", pgx.QueryExecModeExec, false},
		{"simple_protocol", pgx.QueryExecModeSimpleProtocol, false},
		{"cache_describe", pgx.QueryExecModeCacheDescribe, false},
		{"cache_statement+LiteralClaim", pgx.QueryExecModeCacheStatement, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			called := 0
			s, err := inboxdb.NewStore(inboxdb.Config{Tables: tables, LiteralClaim: tc.literal, OnLiteralClaim: func(error) { called++ }})
			require.NoError(t, err)
			pool := poolWithMode(t, testenv.DirectDatabaseURL(), tc.mode, 1)
			conn, err := pool.Acquire(ctx)
			require.NoError(t, err)
			defer conn.Release()
			c := conn.Conn()
			claimCommit(ctx, t, s, c, "c", tc.name)
			claimCommit(ctx, t, s, c, "c", tc.name+"'2")
			tx, res, err := s.BeginClaimPgx(ctx, c, "c", tc.name)
			require.NoError(t, err)
			require.Nil(t, tx)
			require.Equal(t, int64(1), res.Existing.Duplicates)
			stmts, _ := sessionStatements(ctx, t, c)
			require.Empty(t, stmts)
			require.Zero(t, called)
		})
	}
}

// The fallback: when the statement a connection prepared is not in the
// session its claim runs in (here deallocated behind the store's back; a
// pooler's server connection changing under the client in real life), or
// its name is taken when the connection prepares it, the claim is rolled
// back and made again with the literal INSERT, which the store uses from
// then on; OnLiteralClaim is called once. No claim is lost or doubled.
func TestBeginClaimPgxPreparedFallback(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool := poolWithMode(t, testenv.DirectDatabaseURL(), pgx.QueryExecModeCacheStatement, 4)

	t.Run("missing", func(t *testing.T) {
		for _, existing := range []bool{false, true} {
			t.Run(fmt.Sprintf("existing=%v", existing), func(t *testing.T) {
				tables := testenv.Schema(t)
				var causes []error
				s, err := inboxdb.NewStore(inboxdb.Config{Tables: tables, OnLiteralClaim: func(err error) { causes = append(causes, err) }})
				require.NoError(t, err)
				conn, err := pool.Acquire(ctx)
				require.NoError(t, err)
				defer conn.Release()
				c := conn.Conn()
				claimCommit(ctx, t, s, c, "c", "k1")
				_, err = c.Exec(ctx, "DEALLOCATE "+s.PreparedClaimName())
				require.NoError(t, err)

				key := "k2"
				if existing {
					key = "k1" // the retried claim is a duplicate
				}
				tx, res, err := s.BeginClaimPgx(ctx, c, "c", key)
				require.NoError(t, err)
				require.True(t, s.PreparedClaimOff())
				require.Len(t, causes, 1)
				require.Equal(t, "26000", pgerr.Code(causes[0]), causes[0].Error())
				require.Contains(t, causes[0].Error(), s.PreparedClaimName())
				if existing {
					require.Nil(t, tx)
					require.False(t, res.Claimed)
					require.Equal(t, int64(1), res.Existing.Duplicates)
				} else {
					require.True(t, res.Claimed)
					var level string
					require.NoError(t, tx.QueryRow(ctx, "SELECT count(*)::text FROM "+s.Table()+" WHERE message_key = 'k2'").Scan(&level))
					require.Equal(t, "1", level, "the retried claim's row, in its transaction")
					require.NoError(t, tx.Commit(ctx))
				}
				require.Equal(t, byte('I'), c.PgConn().TxStatus())

				// From now on literal, on every connection: nothing prepared.
				claimCommit(ctx, t, s, c, "c", "k3")
				other, err := pool.Acquire(ctx)
				require.NoError(t, err)
				defer other.Release()
				before, _ := sessionStatements(ctx, t, other.Conn())
				claimCommit(ctx, t, s, other.Conn(), "c", "k4")
				after, _ := sessionStatements(ctx, t, other.Conn())
				require.Equal(t, before, after, "no statement prepared after the fallback")
				stmts, _ := sessionStatements(ctx, t, c)
				require.NotContains(t, stmts, s.PreparedClaimName())
				require.Len(t, causes, 1, "called once")

				want := map[string]int64{"k1": 0, "k2": 0, "k3": 0, "k4": 0}
				if existing {
					want = map[string]int64{"k1": 1, "k3": 0, "k4": 0}
				}
				got := map[string]int64{}
				rows, err := c.Query(ctx, "SELECT message_key, duplicates FROM "+s.Table())
				require.NoError(t, err)
				for rows.Next() {
					var k string
					var d int64
					require.NoError(t, rows.Scan(&k, &d))
					got[k] = d
				}
				require.NoError(t, rows.Err())
				require.Equal(t, want, got)
			})
		}
	})

	t.Run("taken", func(t *testing.T) {
		tables := testenv.Schema(t)
		var causes []error
		s, err := inboxdb.NewStore(inboxdb.Config{Tables: tables, OnLiteralClaim: func(err error) { causes = append(causes, err) }})
		require.NoError(t, err)
		// A new connection whose session already has the name (another
		// client of a pooler prepared it there).
		c, err := pgx.Connect(ctx, testenv.DirectDatabaseURL())
		require.NoError(t, err)
		defer func() { _ = c.Close(ctx) }()
		_, err = c.Exec(ctx, "PREPARE "+s.PreparedClaimName()+" AS SELECT 1")
		require.NoError(t, err)

		claimCommit(ctx, t, s, c, "c", "k1")
		require.True(t, s.PreparedClaimOff())
		require.Len(t, causes, 1)
		require.Equal(t, "42P05", pgerr.Code(causes[0]), causes[0].Error())
		claimCommit(ctx, t, s, c, "c", "k2")
		var n int64
		require.NoError(t, c.QueryRow(ctx, "SELECT count(*) FROM "+s.Table()).Scan(&n))
		require.Equal(t, int64(2), n)
		require.Len(t, causes, 1)
	})
}

// Under REPEATABLE READ or SERIALIZABLE as the database's default
// (default_transaction_isolation), the prepared claim's transaction has that
// isolation, and a claim that waited for another's claim of its key ends as
// the literal INSERT's does (on PostgreSQL 15, a duplicate: the plain INSERT
// reports the committed row as a unique violation; a serialization failure
// would be claimed again by the middleware). Neither is taken for a missing
// statement.
func TestBeginClaimPgxPreparedIsolation(t *testing.T) {
	t.Parallel()
	tables := testenv.Schema(t)
	for _, level := range []string{testenv.RepeatableRead, testenv.Serializable} {
		t.Run(strings.ReplaceAll(level, " ", "_"), func(t *testing.T) {
			t.Parallel()
			dbURL := testenv.DatabaseURLWithIsolation(t, level)
			var outcomes []string
			for _, literal := range []bool{false, true} {
				t.Run(fmt.Sprintf("literal=%v", literal), func(t *testing.T) {
					pool := poolWithMode(t, dbURL, pgx.QueryExecModeCacheStatement, 3)
					outcomes = append(outcomes, claimRace(t, pool, tables, level, literal))
				})
			}
			require.Len(t, outcomes, 2)
			require.Equal(t, outcomes[1], outcomes[0], "prepared and literal claims end alike")
		})
	}
}

// claimRace makes a claim wait for another claim of its key, which
// commits, and returns how it ended: "duplicate", or "40001, then
// duplicate".
func claimRace(t *testing.T, pool *pgxpool.Pool, tables sqlschema.DB, level string, literal bool) string {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	called := 0
	s, err := inboxdb.NewStore(inboxdb.Config{Tables: tables, LiteralClaim: literal, OnLiteralClaim: func(error) { called++ }})
	require.NoError(t, err)
	c1, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer c1.Release()
	c2, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer c2.Release()
	key := testenv.Unique(t, "k")
	claimCommit(ctx, t, s, c2.Conn(), "c", key+"-warm") // c2 prepares its statement

	tx1, res, err := s.BeginClaimPgx(ctx, c1.Conn(), "c", key)
	require.NoError(t, err)
	require.True(t, res.Claimed)
	var got string
	require.NoError(t, tx1.QueryRow(ctx, "SHOW transaction_isolation").Scan(&got))
	require.Equal(t, level, got)

	type result struct {
		tx  pgx.Tx
		res inboxdb.ClaimResult
		err error
	}
	second := make(chan result, 1)
	go func() {
		tx, res, err := s.BeginClaimPgx(ctx, c2.Conn(), "c", key)
		second <- result{tx, res, err}
	}()
	// The second claim waits on the first one's row.
	require.Eventually(t, func() bool {
		var waiting int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND strpos(query, $1) > 0`, key).Scan(&waiting)
		return err == nil && waiting == 1
	}, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, tx1.Commit(ctx))
	r := <-second
	require.Nil(t, r.tx)
	require.Equal(t, byte('I'), c2.Conn().PgConn().TxStatus())
	outcome := "duplicate"
	if r.err != nil {
		require.True(t, pgerr.SerializationFailure(r.err), r.err.Error())
		tx, res, err := s.BeginClaimPgx(ctx, c2.Conn(), "c", key)
		require.NoError(t, err)
		require.Nil(t, tx)
		r.res, outcome = res, "40001, then duplicate"
	}
	require.False(t, r.res.Claimed)
	require.Equal(t, int64(1), r.res.Existing.Duplicates)
	require.Equal(t, literal, s.PreparedClaimOff())
	require.Zero(t, called)
	stmts, _ := sessionStatements(ctx, t, c2.Conn())
	if literal {
		require.NotContains(t, stmts, s.PreparedClaimName())
	} else {
		require.Contains(t, stmts, s.PreparedClaimName())
	}
	return outcome
}

// Behind PgBouncer in transaction pooling with pgx's default exec mode
// (cache_statement, which docs/pgbouncer.md says not to use there), the
// store's claims find their prepared statement on another server
// connection, or its name taken: they fall back to the literal INSERT.
// 200 concurrent claims of new keys from 16 client connections over 4
// server connections: no error, each key claimed once, the store literal
// for good, OnLiteralClaim called once. (No duplicates: counting one is a
// parameterised query, which pgx's cache_statement mode breaks through
// PgBouncer by itself.)
func TestBeginClaimPgxPreparedThroughPgBouncer(t *testing.T) {
	t.Parallel()
	bouncer := testenv.PgBouncer(t, "transaction")
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	tables := testenv.Schema(t)
	var (
		mu     sync.Mutex
		causes []error
	)
	s, err := inboxdb.NewStore(inboxdb.Config{Tables: tables, OnLiteralClaim: func(err error) {
		mu.Lock()
		defer mu.Unlock()
		causes = append(causes, err)
	}})
	require.NoError(t, err)
	pool := poolWithMode(t, bouncer, pgx.QueryExecModeCacheStatement, 16)

	const keys = 200
	errs := make(chan error, keys)
	var wg sync.WaitGroup
	for i := range keys {
		wg.Go(func() {
			key := fmt.Sprintf("k-%03d", i)
			errs <- func() error {
				conn, err := pool.Acquire(ctx)
				if err != nil {
					return err
				}
				defer conn.Release()
				tx, res, err := s.BeginClaimPgx(ctx, conn.Conn(), "pgbouncer", key)
				if err != nil {
					return err
				}
				if !res.Claimed {
					return errors.New("not claimed")
				}
				return tx.Commit(ctx)
			}()
		})
	}
	wg.Wait()
	close(errs)
	var failed []error
	for err := range errs {
		if err != nil {
			failed = append(failed, err)
		}
	}
	require.Empty(t, failed)
	require.True(t, s.PreparedClaimOff())
	require.Len(t, causes, 1)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, causes[0], &pgErr)
	require.Contains(t, []string{"26000", "42P05"}, pgErr.Code)

	direct := testenv.PoolFor(t, testenv.DirectDatabaseURL())
	var rows, distinct int64
	require.NoError(t, direct.QueryRow(ctx, `SELECT count(*), count(DISTINCT message_key) FROM `+s.Table()).Scan(&rows, &distinct))
	require.Equal(t, int64(keys), rows)
	require.Equal(t, int64(keys), distinct)
}
