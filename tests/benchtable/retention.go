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
//
// With -engines mariadb, MariaDB's plain inbox (a database of its own,
// -retention-rows-mariadb rows filled from a SEQUENCE table with the same
// keys and times) runs in the same rounds, claimed as the middleware claims
// on database/sql (BEGIN, then the claim's statements; the COMMIT not
// timed) and purged by the same Store.Purge.

const (
	keepDays = 7
)

type retentionLayout struct {
	name    string // "partitioned" or "plain"
	engine  engine
	db      sqlschema.DB
	conn    *dbConn
	store   *inboxdb.Store
	layout  *inboxpart.Layout
	days    int
	perDay  int
	workers int       // concurrent claimers
	t0      time.Time // start of the oldest day
	bytes   float64   // bytes per row once filled

	purgeFailed bool // MariaDB's purge failed: no more purges
}

// key names the layout in logs and in the section's maps.
func (l *retentionLayout) key() string { return l.name + l.engine.suffix() }

func (h *harness) retentionSection(ctx context.Context) ([]*line, error) {
	cfg := h.cfg
	days := keepDays + cfg.rounds
	var layouts []*retentionLayout
	for _, e := range cfg.engines {
		c, err := h.openConn(ctx, e, cfg.retentionWorkers+4, nil)
		if err != nil {
			return nil, err
		}
		defer c.close()
		names, rows := []string{"partitioned", "plain"}, cfg.retentionRows
		if e.mysql() {
			names, rows = []string{"plain"}, cfg.retentionRowsMy // MySQL has no partitioned layout
		}
		for _, name := range names {
			l, err := h.newRetentionLayout(ctx, c, name, days, rows/days)
			if err != nil {
				return nil, fmt.Errorf("%s%s: %w", name, e.suffix(), err)
			}
			layouts = append(layouts, l)
		}
	}

	idle := map[string][]float64{}
	during := map[string][]float64{}
	purgeSecs := map[string][]float64{}
	perDay := map[string]int{}
	for r := range cfg.rounds {
		for _, l := range layouts {
			k := l.key()
			perDay[k] = l.perDay
			p99, _, err := l.claims(ctx, cfg.retentionClaims, nil)
			if err != nil {
				return nil, fmt.Errorf("%s: claims: %w", k, err)
			}
			idle[k] = append(idle[k], p99)
			if l.purgeFailed {
				continue
			}

			// Remove the oldest remaining day: records that finished
			// before t0 + (r+1) days.
			olderThan := time.Since(l.t0.AddDate(0, 0, r+1))
			var purged atomic.Int64
			start := time.Now()
			purge := func() error {
				n, err := l.store.Purge(ctx, l.conn.beginner(), inboxdb.PurgeOptions{OlderThan: olderThan})
				purged.Store(n)
				return err
			}
			var took time.Duration
			p99, purgeErr, err := l.claims(ctx, cfg.retentionClaims, func() error {
				err := purge()
				took = time.Since(start)
				return err
			})
			if err == nil && purgeErr != nil && l.engine.mysql() {
				// The MySQL port is young: keep its idle claims' line
				// (on the full inbox from now on) and PostgreSQL's.
				l.purgeFailed = true
				logf("retention %s: THE PURGE FAILED, its lines are left out: %v", k, purgeErr)
				continue
			}
			if err == nil {
				err = purgeErr
			}
			if err != nil {
				return nil, fmt.Errorf("%s: claims during purge: %w", k, err)
			}
			if n := purged.Load(); n < int64(l.perDay)*9/10 {
				return nil, fmt.Errorf("%s: round %d purged %d rows, expected about %d (a day)", k, r+1, n, l.perDay)
			}
			during[k] = append(during[k], p99)
			purgeSecs[k] = append(purgeSecs[k], took.Seconds()*1000)
			logf("retention %s round %d: claim p99 %.0f µs idle, %.0f µs during a purge of %d rows (%s)",
				k, r+1, idle[k][r], p99, purged.Load(), took.Round(time.Millisecond))
		}
	}

	sizes := map[string][]float64{}
	for _, l := range layouts {
		sizes[l.key()] = []float64{l.bytes}
	}
	under := func(limit float64) func(a, b, _ float64) bool {
		return func(a, b, _ float64) bool { return a < limit && b < limit }
	}
	part, plain, myPlain := "partitioned"+postgres.suffix(), "plain"+postgres.suffix(), "plain"+mariadb.suffix()
	var lines []*line
	if cfg.hasEngine(postgres) {
		rows := short(cfg.retentionRows)
		lines = append(lines,
			&line{name: "retention: claim p99, " + rows + "-row inbox" + postgres.suffix(), aName: "partitioned (daily)", bName: "plain",
				a: idle[part], b: idle[plain], unit: "µs", target: "A, B < 1,000 µs", check: under(1000)},
			&line{name: "retention: claim p99 while a day (" + short(perDay[plain]) + " rows) is removed" + postgres.suffix(), aName: "partitioned: drop", bName: "plain: row purge",
				a: during[part], b: during[plain], unit: "µs", target: "A, B < 5,000 µs", check: under(5000)},
			&line{name: "retention: time to remove a day" + postgres.suffix(), aName: "partitioned: drop", bName: "plain: row purge",
				a: purgeSecs[part], b: purgeSecs[plain], unit: "ms", target: "—"},
			&line{name: "retention: inbox bytes per row (36-byte keys, filled)" + postgres.suffix(), aName: "partitioned", bName: "plain",
				a: sizes[part], b: sizes[plain], unit: "B", target: "—"})
	}
	switch {
	case cfg.hasEngine(mariadb) && cfg.hasEngine(postgres):
		rows := short(cfg.retentionRows)
		if cfg.retentionRowsMy != cfg.retentionRows {
			rows = "MariaDB's " + short(cfg.retentionRowsMy) + ", PostgreSQL's " + short(cfg.retentionRows)
		}
		plainInbox := "plain inbox (" + rows + " rows)"
		lines = append(lines,
			&line{name: "retention: claim p99, " + plainInbox + ": engine", aName: string(mariadb), bName: string(postgres),
				a: idle[myPlain], b: idle[plain], unit: "µs", target: "A, B < 1,000 µs", check: under(1000)},
			&line{name: "retention: claim p99 while a day is removed by row purge: engine", aName: string(mariadb), bName: string(postgres),
				a: during[myPlain], b: during[plain], unit: "µs", target: "A, B < 5,000 µs", check: under(5000)},
			&line{name: "retention: time to remove a day by row purge, " + plainInbox + ": engine", aName: string(mariadb), bName: string(postgres),
				a: purgeSecs[myPlain], b: purgeSecs[plain], unit: "ms", target: "—"},
			&line{name: "retention: plain inbox bytes per row (36-byte keys, filled): engine", aName: string(mariadb), bName: string(postgres),
				a: sizes[myPlain], b: sizes[plain], unit: "B", target: "—"})
	case cfg.hasEngine(mariadb):
		lines = append(lines, &line{name: "retention: claim p99, " + short(cfg.retentionRowsMy) + "-row plain inbox" + mariadb.suffix(), aName: "idle",
			bName: "while a day (" + short(perDay[myPlain]) + " rows) is removed by row purge",
			a:     idle[myPlain], b: during[myPlain], unit: "µs", target: "A < 1,000 µs, B < 5,000 µs", check: func(a, b, _ float64) bool { return a < 1000 && b < 5000 }})
	}
	kept := lines[:0]
	for _, l := range lines {
		if len(l.a) == 0 || len(l.b) == 0 {
			logf("retention: line %q left out: no values", l.name)
			continue
		}
		kept = append(kept, l)
	}
	return kept, nil
}

// newRetentionLayout creates and fills one layout's inbox on c's engine.
func (h *harness) newRetentionLayout(ctx context.Context, c *dbConn, name string, days, perDay int) (*retentionLayout, error) {
	db := sqlschema.DB{}
	if name == "partitioned" {
		db.Partitions = &sqlschema.Partitioning{Interval: sqlschema.Daily, Ahead: 2}
	}
	var err error
	if c.engine.mysql() {
		db, err = h.newSchemaOn(ctx, c.engine, "ret_"+name)
	} else {
		db, err = h.newSchemaWith(ctx, "ret_"+name, db)
	}
	if err != nil {
		return nil, err
	}
	db.Conn = c.beginner()
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	if err != nil {
		return nil, err
	}
	l := &retentionLayout{name: name, engine: c.engine, db: db, conn: c, store: store, days: days, perDay: perDay, workers: h.cfg.retentionWorkers}
	var now time.Time
	if c.std != nil {
		err = c.std.QueryRowContext(ctx, mustSQL(c.engine, "Now", sqlData{})).Scan(&now)
	} else {
		err = c.pg.QueryRow(ctx, mustSQL(c.engine, "Now", sqlData{})).Scan(&now)
	}
	if err != nil {
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
			if _, err := c.pg.Exec(ctx, "CREATE TABLE "+q+" (LIKE "+pl.Parent()+" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)"); err != nil {
				return nil, err
			}
			if _, err := c.pg.Exec(ctx, "ALTER TABLE "+pl.Parent()+" ATTACH PARTITION "+q+" FOR VALUES FROM ("+
				inboxpart.Literal(from)+") TO ("+inboxpart.Literal(from.AddDate(0, 0, 1))+")"); err != nil {
				return nil, err
			}
		}
	}
	start := time.Now()
	// One statement per day (on MariaDB per chunk of a day), in time order
	// (as claims arrive), each row a done record with a 36-byte key (a
	// UUID's text) finished when claimed.
	step := time.Duration(int64(24*time.Hour) / int64(perDay))
	for d := range days {
		from := l.t0.AddDate(0, 0, d)
		first, last := d*perDay, (d+1)*perDay-1
		if c.std == nil {
			q := mustSQL(postgres, "FillInboxDay", sqlData{Inbox: db.Inbox(), Partitioned: name == "partitioned"})
			if _, err := c.pg.Exec(ctx, q, int64(first), int64(last), from, step); err != nil {
				return nil, fmt.Errorf("filling day %d: %w", d, err)
			}
			continue
		}
		const chunk = 200_000
		for lo := first; lo <= last; lo += chunk {
			q := mustSQL(mariadb, "FillInboxDay", sqlData{Inbox: db.Inbox(), From: lo, To: min(lo+chunk-1, last)})
			if _, err := c.std.ExecContext(ctx, q, from, first, step.Microseconds()); err != nil {
				return nil, fmt.Errorf("filling day %d: %w", d, err)
			}
		}
	}
	if l.bytes, err = l.bytesPerRow(ctx); err != nil {
		return nil, err
	}
	logf("retention %s: %d rows over %d days filled in %s, %.0f bytes per row", l.key(), days*perDay, days, time.Since(start).Round(time.Second), l.bytes)
	return l, nil
}

// claim claims key as the middleware does on l's engine and returns how
// long the claim took (the COMMIT after it is not timed: it costs the same
// log flush whatever the inbox). PostgreSQL: the pgx one-round-trip claim
// (BEGIN, lock, look-up, INSERT); MariaDB: BEGIN, then the claim's
// statements on database/sql.
func (l *retentionLayout) claim(ctx context.Context, key string) (time.Duration, error) {
	start := time.Now()
	if l.conn.std == nil {
		tx, _, err := l.store.BeginClaimPool(ctx, l.conn.pg, "bench", key)
		took := time.Since(start)
		if err == nil && tx != nil {
			err = tx.Commit()
		}
		return took, err
	}
	tx, err := l.conn.beginner().BeginTx(ctx, nil)
	if err != nil {
		return 0, err
	}
	if _, err := l.store.ClaimTx(ctx, tx, "bench", key); err != nil {
		_ = tx.Rollback()
		return 0, err
	}
	took := time.Since(start)
	return took, tx.Commit()
}

// claims times n claims (at least; and, with during, until during has
// returned) from l.workers workers and returns their p99 in µs and
// during's error.
func (l *retentionLayout) claims(ctx context.Context, n int, during func() error) (float64, error, error) {
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
			duringEr = recovered(during)
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
				var took time.Duration
				err := recovered(func() error {
					var err error
					took, err = l.claim(ctx, key)
					return err
				})
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

// recovered runs f, turning a panic into an error: a panic in a claimer or
// purge goroutine would end the process before cleanup dropped what the
// run created.
func recovered(f func() error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = fmt.Errorf("panic: %v", p)
		}
	}()
	return f()
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

// bytesPerRow is the inbox's total size over its rows: on PostgreSQL
// heap, indexes, TOAST, every partition; on MariaDB InnoDB's estimate of
// data and indexes after ANALYZE TABLE.
func (l *retentionLayout) bytesPerRow(ctx context.Context) (float64, error) {
	if err := l.conn.exec(ctx, mustSQL(l.engine, "Analyze", sqlData{Table: l.db.Inbox()})); err != nil {
		return 0, err
	}
	var size, rows int64
	q := mustSQL(l.engine, "InboxSize", sqlData{Inbox: l.db.Inbox()})
	var err error
	if l.conn.std != nil {
		err = l.conn.std.QueryRowContext(ctx, q, l.db.Schema, l.db.InboxTable).Scan(&size, &rows)
	} else {
		err = l.conn.pg.QueryRow(ctx, q, l.db.Inbox()).Scan(&size, &rows)
	}
	if err != nil {
		return 0, err
	}
	if rows == 0 {
		return 0, errors.New("empty inbox")
	}
	return float64(size) / float64(rows), nil
}
