package inboxdb_test

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// BenchmarkPartitionedClaim compares, on one daily-partitioned inbox
// filled like the benchtable's retention section (done records of 36-byte
// keys spread over the past days, one partition per day), the claims
// before and after the claim functions of migration inbox_002:
//
//   - statements: the key's lock, then the look-up and insert (the pgx
//     fast path: BEGIN with the lock, then the prepared insert);
//   - function: one call of <table>_claim (the pgx fast path: with its
//     BEGIN, one round trip).
//
// Each round times claims (BeginClaimPool, then COMMIT, which is not timed;
// one in ten a redelivery of a recorded key) with each variant in turn, the
// order alternating, first on the idle inbox and then while Store.Purge
// drops the oldest remaining day; and group-commit batches (ClaimBatchTx of
// 32 keys, rolled back). It reports the p50 and p99 of all the rounds'
// claims per variant (µs), and of the redeliveries among them.
//
//	EO_PARTBENCH_ROWS=2000000 EO_PARTBENCH_ROUNDS=3 go test -run '^$' -bench BenchmarkPartitionedClaim -benchtime 1x ./internal/inboxdb/
func BenchmarkPartitionedClaim(b *testing.B) {
	rows := envInt("EO_PARTBENCH_ROWS", 200000)
	rounds := envInt("EO_PARTBENCH_ROUNDS", 2)
	claims := envInt("EO_PARTBENCH_CLAIMS", 3000)
	const keep = 7
	days := keep + 2*rounds // each round drops one day per variant
	perDay := rows / days
	ctx := context.Background()

	tables := testenv.SchemaWith(b, sqlschema.DB{Partitions: &sqlschema.Partitioning{Interval: sqlschema.Daily, Ahead: 2}})
	pool := testenv.Pool(b)
	var now time.Time
	require.NoError(b, pool.QueryRow(ctx, "SELECT now()").Scan(&now))
	t0 := now.UTC().Truncate(24*time.Hour).AddDate(0, 0, -days)
	pl := inboxpart.Layout{Schema: tables.Schema, Table: tables.InboxTable}
	for d := range days {
		from := t0.AddDate(0, 0, d)
		q := pl.Quoted(pl.Name(from))
		_, err := pool.Exec(ctx, "CREATE TABLE "+q+" (LIKE "+pl.Parent()+" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
		require.NoError(b, err)
		_, err = pool.Exec(ctx, "ALTER TABLE "+pl.Parent()+" ATTACH PARTITION "+q+" FOR VALUES FROM ("+
			inboxpart.Literal(from)+") TO ("+inboxpart.Literal(from.AddDate(0, 0, 1))+")")
		require.NoError(b, err)
		_, err = pool.Exec(ctx, `INSERT INTO `+tables.Inbox()+` (consumer, message_key, status, attempts, first_seen_at, processed_at, partition_at)
SELECT 'bench', md5(g::text)::uuid::text, 'done', 1, t, t, t
FROM generate_series($1::bigint, $2::bigint) g, LATERAL (SELECT $3::timestamptz + (g - $1) * $4::interval AS t) x`,
			int64(d*perDay), int64((d+1)*perDay-1), from, time.Duration(int64(24*time.Hour)/int64(perDay)))
		require.NoError(b, err)
	}
	_, err := pool.Exec(ctx, "VACUUM ANALYZE "+tables.Inbox())
	require.NoError(b, err)

	names := []string{"statements", "function"}
	stores := make([]*inboxdb.Store, 2)
	for i := range stores {
		stores[i], err = inboxdb.NewStore(inboxdb.Config{Tables: tables})
		require.NoError(b, err)
		stores[i].UseClaimFunctions(i == 1)
	}
	rng := rand.New(rand.NewPCG(1, uint64(time.Now().UnixNano())))
	redelivery := false
	key := func() string {
		redelivery = rng.IntN(10) == 0
		if redelivery {
			sum := md5.Sum([]byte(strconv.Itoa(rng.IntN(days * perDay))))
			return uuidText(sum[:])
		}
		var buf [16]byte
		for i := range buf {
			buf[i] = byte(rng.Uint32())
		}
		return uuidText(buf[:])
	}
	redeliveries := map[bool][]float64{} // by store: function
	claim := func(s *inboxdb.Store) time.Duration {
		k := key()
		start := time.Now()
		tx, _, err := s.BeginClaimPool(ctx, pool, "bench", k)
		took := time.Since(start)
		require.NoError(b, err)
		if redelivery {
			redeliveries[s == stores[1]] = append(redeliveries[s == stores[1]], float64(took.Microseconds()))
		}
		if tx != nil {
			require.NoError(b, tx.Commit())
		}
		return took
	}
	idle, during, batch := make([][]float64, 2), make([][]float64, 2), make([][]float64, 2)
	dropped := 0
	for r := range rounds {
		for j := range 2 {
			v := (r + j) % 2
			for range claims {
				idle[v] = append(idle[v], float64(claim(stores[v]).Microseconds()))
			}
			// Batches of 32 keys, rolled back.
			for range claims / 32 {
				keys := make([]string, 32)
				for i := range keys {
					keys[i] = key()
				}
				slices.Sort(keys)
				keys = slices.Compact(keys)
				start := time.Now()
				tx, err := wsql.BeginnerFromPgx(pool).BeginTx(ctx, nil)
				require.NoError(b, err)
				_, _, err = stores[v].ClaimBatchTx(ctx, tx, "bench", keys)
				batch[v] = append(batch[v], float64(time.Since(start).Microseconds()))
				require.NoError(b, err)
				require.NoError(b, tx.Rollback())
			}
			// A purge of the oldest remaining day, claims meanwhile.
			dropped++
			olderThan := time.Since(t0.AddDate(0, 0, dropped))
			done := make(chan error, 1)
			go func() {
				_, err := stores[v].Purge(ctx, wsql.BeginnerFromPgx(pool), inboxdb.PurgeOptions{OlderThan: olderThan})
				done <- err
			}()
			n := 0
			for finished := false; !finished || n < claims; n++ {
				during[v] = append(during[v], float64(claim(stores[v]).Microseconds()))
				select {
				case err := <-done:
					require.NoError(b, err)
					finished = true
				default:
				}
			}
		}
	}
	for v, name := range names {
		for _, m := range []struct {
			what string
			lat  []float64
		}{{"idle", idle[v]}, {"purge", during[v]}, {"redelivery", redeliveries[v == 1]}, {"batch32", batch[v]}} {
			slices.Sort(m.lat)
			p50, p99 := m.lat[len(m.lat)/2], m.lat[len(m.lat)*99/100]
			b.ReportMetric(p50, name+"-"+m.what+"-p50-µs")
			b.ReportMetric(p99, name+"-"+m.what+"-p99-µs")
			fmt.Fprintf(os.Stderr, "%-10s %-10s n=%6d p50 %6.0f µs  p99 %6.0f µs\n", name, m.what, len(m.lat), p50, p99)
		}
	}
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func uuidText(b []byte) string {
	h := hex.EncodeToString(b)
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}
