package main

import (
	"context"
	"crypto/md5"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The retention section: claim latency on a large inbox, and while
// retention removes a day of rows, for the plain table (row purge in
// batches of 1000) and the daily-partitioned one (partition drop).
//
// Each layout's inbox is filled once, set-based (INSERT ... SELECT
// generate_series), with -retention-rows done records of 36-byte keys,
// spread evenly over keepDays + rounds days: the last keepDays days are
// inside retention, and each round's purge removes the oldest remaining
// day. A round times -retention-claims claims (the middleware's pgx
// one-round-trip claim, from -retention-workers workers (default 1), each followed by its COMMIT, which
// is not timed: it costs the same WAL flush whatever the inbox; one in ten
// a redelivery of a recorded key) first on the idle inbox, then while that
// round's purge runs (claims continue until the purge has ended and at
// least as many were timed). The values are each round's p99.

const (
	keepDays = 7
)

type retentionLayout struct {
	name    string
	db      sqlschema.DB
	store   *inboxdb.Store
	layout  *inboxpart.Layout
	days    int
	perDay  int
	workers int       // concurrent claimers
	t0      time.Time // start of the oldest day
	bytes   float64   // bytes per row once filled
}

func (h *harness) retentionSection(ctx context.Context) ([]*line, error) {
	cfg := h.cfg
	pool, err := newPool(ctx, cfg.dbURL, cfg.retentionWorkers+4, "")
	if err != nil {
		return nil, err
	}
	defer pool.Close()

	days := keepDays + cfg.rounds
	perDay := cfg.retentionRows / days
	var layouts []*retentionLayout
	for _, name := range []string{"partitioned", "plain"} {
		l, err := h.newRetentionLayout(ctx, pool, name, days, perDay)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		layouts = append(layouts, l)
	}

	idle := map[string][]float64{}
	during := map[string][]float64{}
	purgeSecs := map[string][]float64{}
	for r := range cfg.rounds {
		for _, l := range layouts {
			p99, _, err := l.claims(ctx, pool, cfg.retentionClaims, nil)
			if err != nil {
				return nil, fmt.Errorf("%s: claims: %w", l.name, err)
			}
			idle[l.name] = append(idle[l.name], p99)

			// Remove the oldest remaining day: records that finished
			// before t0 + (r+1) days.
			olderThan := time.Since(l.t0.AddDate(0, 0, r+1))
			var purged atomic.Int64
			start := time.Now()
			purge := func() error {
				n, err := l.store.Purge(ctx, wsql.BeginnerFromPgx(pool), inboxdb.PurgeOptions{OlderThan: olderThan})
				purged.Store(n)
				return err
			}
			var took time.Duration
			p99, purgeErr, err := l.claims(ctx, pool, cfg.retentionClaims, func() error {
				err := purge()
				took = time.Since(start)
				return err
			})
			if err == nil {
				err = purgeErr
			}
			if err != nil {
				return nil, fmt.Errorf("%s: claims during purge: %w", l.name, err)
			}
			if n := purged.Load(); n < int64(l.perDay)*9/10 {
				return nil, fmt.Errorf("%s: round %d purged %d rows, expected about %d (a day)", l.name, r+1, n, l.perDay)
			}
			during[l.name] = append(during[l.name], p99)
			purgeSecs[l.name] = append(purgeSecs[l.name], took.Seconds()*1000)
			logf("retention %s round %d: claim p99 %.0f µs idle, %.0f µs during a purge of %d rows (%s)",
				l.name, r+1, idle[l.name][r], p99, purged.Load(), took.Round(time.Millisecond))
		}
	}

	sizes := map[string][]float64{}
	for _, l := range layouts {
		sizes[l.name] = []float64{l.bytes}
	}
	rows := short(cfg.retentionRows)
	under := func(limit float64) func(a, b, _ float64) bool {
		return func(a, b, _ float64) bool { return a < limit && b < limit }
	}
	return []*line{
		{name: "retention: claim p99, " + rows + "-row inbox", aName: "partitioned (daily)", bName: "plain",
			a: idle["partitioned"], b: idle["plain"], unit: "µs", target: "A, B < 1,000 µs", check: under(1000)},
		{name: "retention: claim p99 while a day (" + short(perDay) + " rows) is removed", aName: "partitioned: drop", bName: "plain: row purge",
			a: during["partitioned"], b: during["plain"], unit: "µs", target: "A, B < 5,000 µs", check: under(5000)},
		{name: "retention: time to remove a day", aName: "partitioned: drop", bName: "plain: row purge",
			a: purgeSecs["partitioned"], b: purgeSecs["plain"], unit: "ms", target: "—"},
		{name: "retention: inbox bytes per row (36-byte keys, filled)", aName: "partitioned", bName: "plain",
			a: sizes["partitioned"], b: sizes["plain"], unit: "B", target: "—"},
	}, nil
}

// newRetentionLayout creates and fills one layout's inbox.
func (h *harness) newRetentionLayout(ctx context.Context, pool *pgxpool.Pool, name string, days, perDay int) (*retentionLayout, error) {
	db := sqlschema.DB{}
	if name == "partitioned" {
		db.Partitions = &sqlschema.Partitioning{Interval: sqlschema.Daily, Ahead: 2}
	}
	db, err := h.newSchemaWith(ctx, "ret_"+name, db)
	if err != nil {
		return nil, err
	}
	db.Conn = wsql.BeginnerFromPgx(pool)
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	if err != nil {
		return nil, err
	}
	l := &retentionLayout{name: name, db: db, store: store, days: days, perDay: perDay, workers: h.cfg.retentionWorkers}
	var now time.Time
	if err := pool.QueryRow(ctx, "SELECT now()").Scan(&now); err != nil {
		return nil, err
	}
	// Day d (0 = oldest) is [t0 + d days, t0 + d+1 days); the last one ends
	// at today's midnight (UTC), so that the current partition stays free
	// for the timed claims.
	today := now.UTC().Truncate(24 * time.Hour)
	l.t0 = today.AddDate(0, 0, -days)
	if name == "partitioned" {
		pl := inboxpart.Layout{Schema: db.Schema, Table: db.InboxTable}
		l.layout = &pl
		for d := range days {
			from := l.t0.AddDate(0, 0, d)
			q := pl.Quoted(pl.Name(from))
			if _, err := pool.Exec(ctx, "CREATE TABLE "+q+" (LIKE "+pl.Parent()+" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"); err != nil {
				return nil, err
			}
			if _, err := pool.Exec(ctx, "ALTER TABLE "+pl.Parent()+" ATTACH PARTITION "+q+" FOR VALUES FROM ("+
				inboxpart.Literal(from)+") TO ("+inboxpart.Literal(from.AddDate(0, 0, 1))+")"); err != nil {
				return nil, err
			}
		}
	}
	start := time.Now()
	// One statement per day, in time order (as claims arrive), each row a
	// done record with a 36-byte key (a UUID's text) finished when claimed.
	partCol, partVal := "", ""
	if name == "partitioned" {
		partCol, partVal = ", partition_at", ", t"
	}
	for d := range days {
		from := l.t0.AddDate(0, 0, d)
		q := `INSERT INTO ` + db.Inbox() + ` (consumer, message_key, status, attempts, first_seen_at, processed_at` + partCol + `)
SELECT 'bench', md5(g::text)::uuid::text, 'done', 1, t, t` + partVal + `
FROM generate_series($1::bigint, $2::bigint) g, LATERAL (SELECT $3::timestamptz + (g - $1) * $4::interval AS t) x`
		step := time.Duration(int64(24*time.Hour) / int64(perDay))
		if _, err := pool.Exec(ctx, q, int64(d*perDay), int64((d+1)*perDay-1), from, step); err != nil {
			return nil, fmt.Errorf("filling day %d: %w", d, err)
		}
	}
	if l.bytes, err = l.bytesPerRow(ctx, pool); err != nil {
		return nil, err
	}
	logf("retention %s: %d rows over %d days filled in %s, %.0f bytes per row", name, days*perDay, days, time.Since(start).Round(time.Second), l.bytes)
	return l, nil
}

// claims times n claims (at least; and, with during, until during has
// returned) from l.workers workers and returns their p99 in µs and
// during's error.
func (l *retentionLayout) claims(ctx context.Context, pool *pgxpool.Pool, n int, during func() error) (float64, error, error) {
	var (
		mu       sync.Mutex
		lat      = make([]float64, 0, n)
		duringOK atomic.Bool
		duringEr error
		count    atomic.Int64
		firstErr error
		wg       sync.WaitGroup
	)
	if during == nil {
		duringOK.Store(true)
	} else {
		wg.Go(func() {
			duringEr = during()
			duringOK.Store(true)
		})
	}
	total := int64(l.days * l.perDay)
	for w := range l.workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), uint64(time.Now().UnixNano())))
			for count.Load() < int64(n) || !duringOK.Load() {
				var key string
				if rng.IntN(10) == 0 {
					// A redelivery of a recorded key (maybe purged meanwhile).
					key = uuidOfMD5(rng.Int64N(total))
				} else {
					key = uuidOf(rng.Uint64(), rng.Uint64())
				}
				start := time.Now()
				tx, _, err := l.store.BeginClaimPool(ctx, pool, "bench", key)
				took := time.Since(start) // the claim: BEGIN, lock, look-up, INSERT
				if err == nil && tx != nil {
					err = tx.Commit()
				}
				if err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
					return
				}
				count.Add(1)
				mu.Lock()
				lat = append(lat, float64(took.Microseconds()))
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	if firstErr != nil {
		return 0, duringEr, firstErr
	}
	if len(lat) == 0 {
		return 0, duringEr, errors.New("no claim timed")
	}
	slices.Sort(lat)
	return lat[len(lat)*99/100], duringEr, nil
}

// uuidOfMD5 is the key the fill gave row g: md5(g::text)::uuid::text.
func uuidOfMD5(g int64) string {
	sum := md5.Sum([]byte(strconv.FormatInt(g, 10)))
	return uuidText(sum[:])
}

// uuidOf is a random 36-byte key, like a message UUID.
func uuidOf(a, b uint64) string {
	var buf [16]byte
	binary.BigEndian.PutUint64(buf[:8], a)
	binary.BigEndian.PutUint64(buf[8:], b)
	return uuidText(buf[:])
}

func uuidText(b []byte) string {
	h := hex.EncodeToString(b)
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}

// bytesPerRow is the inbox's total size (heap, indexes, TOAST; every
// partition) over its rows.
func (l *retentionLayout) bytesPerRow(ctx context.Context, pool *pgxpool.Pool) (float64, error) {
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+l.db.Inbox()); err != nil {
		return 0, err
	}
	var size, rows int64
	q := `SELECT pg_total_relation_size($1::regclass) + coalesce((SELECT sum(pg_total_relation_size(inhrelid)) FROM pg_inherits WHERE inhparent = $1::regclass), 0),
(SELECT count(*) FROM ` + l.db.Inbox() + `)`
	if err := pool.QueryRow(ctx, q, l.db.Inbox()).Scan(&size, &rows); err != nil {
		return 0, err
	}
	if rows == 0 {
		return 0, errors.New("empty inbox")
	}
	return float64(size) / float64(rows), nil
}
