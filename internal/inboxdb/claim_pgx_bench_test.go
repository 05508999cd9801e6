package inboxdb_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// BenchmarkBeginClaimPgx claims new keys one after the other on one
// connection straight to PostgreSQL, with two implementations side by side:
//
//   - literal: Store.BeginClaimPgx, "BEGIN; INSERT ... VALUES ('consumer',
//     'key', ...)", parsed and planned on every claim;
//   - prepared: the fast path before issue 8 (reimplemented below),
//     "BEGIN; EXECUTE stmt('consumer', 'key')" with the INSERT prepared
//     once per session by SQL-level PREPARE, which PgBouncer's transaction
//     pooling breaks.
//
// Every iteration makes one claim with each, in alternating order, each
// followed by ROLLBACK (the claim's cost alone, no WAL flush) or COMMIT
// (what a handler pays), so that drift (table growth, a disk stall, other
// load) hits both alike. It reports each one's mean µs per claim (claim and
// end of transaction) and ratio = literal / prepared; ns/op covers both.
//
//	go test -run '^$' -bench BenchmarkBeginClaimPgx -benchtime 2000x -count 5 ./inbox/
func BenchmarkBeginClaimPgx(b *testing.B) {
	tables := testenv.Schema(b)
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
	require.NoError(b, err)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.DirectDatabaseURL())
	require.NoError(b, err)
	b.Cleanup(func() { _ = conn.Close(ctx) })
	prepared := &prepareExecuteClaim{table: store.Table(), stmt: "bench_claim"}
	literal := func(ctx context.Context, conn *pgx.Conn, consumer, key string) (pgx.Tx, error) {
		tx, res, err := store.BeginClaimPgx(ctx, conn, consumer, key)
		if err == nil && !res.Claimed {
			err = errors.New("not claimed")
		}
		return tx, err
	}
	variants := []func(ctx context.Context, conn *pgx.Conn, consumer, key string) (pgx.Tx, error){prepared.begin, literal}

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

// prepareExecuteClaim is the claim of the pgx fast path before issue 8
// (new keys only): the INSERT is a SQL-level prepared statement of the
// session, created when EXECUTE reports that it does not exist.
type prepareExecuteClaim struct {
	table, stmt string
}

func (p *prepareExecuteClaim) begin(ctx context.Context, conn *pgx.Conn, consumer, key string) (pgx.Tx, error) {
	qc, err := conn.PgConn().EscapeString(consumer)
	if err != nil {
		return nil, err
	}
	qk, err := conn.PgConn().EscapeString(key)
	if err != nil {
		return nil, err
	}
	begin := `BEGIN; EXECUTE ` + p.stmt + `('` + qc + `', '` + qk + `')`
	for attempt := 0; attempt < 2; attempt++ {
		tx, err := conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: begin})
		if err == nil {
			return tx, nil
		}
		if conn.PgConn().TxStatus() != 'I' {
			if _, rbErr := conn.Exec(ctx, "ROLLBACK"); rbErr != nil {
				return nil, rbErr
			}
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "26000" { // no such prepared statement
			return nil, err
		}
		if _, err := conn.Exec(ctx, `PREPARE `+p.stmt+` (text, text) AS INSERT INTO `+p.table+
			` (consumer, message_key, status, attempts, processed_at) VALUES ($1, $2, 'done', 1, now())`); err != nil {
			return nil, err
		}
	}
	return nil, errors.New("the prepared statement kept disappearing")
}
