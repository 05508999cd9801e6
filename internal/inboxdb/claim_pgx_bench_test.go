package inboxdb_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// BenchmarkBeginClaimPgx claims new keys one after the other on one
// connection straight to PostgreSQL (pgx's default exec mode,
// cache_statement), with Store.BeginClaimPgx's two claims side by side:
//
//   - prepared: "BEGIN; EXECUTE stmt('consumer', 'key')", the INSERT
//     prepared once per session by SQL-level PREPARE (the default on a
//     cache_statement connection);
//   - literal: "BEGIN; INSERT ... VALUES ('consumer', 'key', ...)", parsed
//     and planned on every claim (Config.LiteralClaim, and any other exec
//     mode: what PgBouncer's transaction pooling gets).
//
// Every iteration makes one claim with each, in alternating order, each
// followed by ROLLBACK (the claim's cost alone, no WAL flush) or COMMIT
// (what a handler pays), so that drift (table growth, a disk stall, other
// load) hits both alike. It reports each one's mean µs per claim (claim and
// end of transaction) and ratio = literal / prepared; ns/op covers both.
//
//	go test -run '^$' -bench BenchmarkBeginClaimPgx -benchtime 2000x -count 5 ./internal/inboxdb/
func BenchmarkBeginClaimPgx(b *testing.B) {
	tables := testenv.Schema(b)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.DirectDatabaseURL())
	require.NoError(b, err)
	b.Cleanup(func() { _ = conn.Close(ctx) })
	require.Equal(b, pgx.QueryExecModeCacheStatement, conn.Config().DefaultQueryExecMode)
	claim := func(literal bool) func(ctx context.Context, conn *pgx.Conn, consumer, key string) (pgx.Tx, error) {
		store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables, LiteralClaim: literal,
			OnLiteralClaim: func(err error) { b.Errorf("the prepared claim was turned off: %v", err) }})
		require.NoError(b, err)
		return func(ctx context.Context, conn *pgx.Conn, consumer, key string) (pgx.Tx, error) {
			tx, res, err := store.BeginClaimPgx(ctx, conn, consumer, key)
			if err == nil && !res.Claimed {
				err = errors.New("not claimed")
			}
			return tx, err
		}
	}
	variants := []func(ctx context.Context, conn *pgx.Conn, consumer, key string) (pgx.Tx, error){claim(false), claim(true)}

	run := 0
	for _, end := range []string{"rollback", "commit"} {
		b.Run(end, func(b *testing.B) {
			run++
			var spent [2]time.Duration
			for i := 0; i < b.N; i++ {
				for j := range 2 {
					v := (i + j) % 2
					key := fmt.Sprintf("k-%d-%d-%08d", run, v, i)
					start := time.Now()
					tx, err := variants[v](ctx, conn, "bench", key)
					if err != nil {
						b.Fatal(err)
					}
					if end == "commit" {
						err = tx.Commit(ctx)
					} else {
						err = tx.Rollback(ctx)
					}
					if err != nil {
						b.Fatal(err)
					}
					spent[v] += time.Since(start)
				}
			}
			perClaim := func(d time.Duration) float64 { return float64(d.Microseconds()) / float64(b.N) }
			b.ReportMetric(perClaim(spent[0]), "prepared-µs/claim")
			b.ReportMetric(perClaim(spent[1]), "literal-µs/claim")
			b.ReportMetric(spent[1].Seconds()/spent[0].Seconds(), "ratio")
		})
	}
}
