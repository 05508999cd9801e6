package chaos

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	mrand "math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The partitioned inbox with purges during traffic while partition
// maintenance is behind. Each round starts from a table whose newest
// partition ended yesterday at midnight (so every claim is a fallback
// write into it) and an older one past retention holding records to drop
// and records to keep. Up to seven middlewares share the table, one
// consumer each: per-message transactional (pgx pool, database/sql, and a
// pgx pool through PgBouncer in transaction pooling), group commit (both
// drivers) and, every other round, lease mode (both drivers). Their
// workers deliver every key once, copies of many of them (at the same
// moment or later: redeliveries of keys already processed), and Permanent
// failures for a few. Purges run again and again (alternately through
// PgBouncer and database/sql), with a retention of a minute, once traffic
// is going: the first one retires the partition the claims in flight
// write into.
//
// Invariants: every key's effect (a row written in the handler's
// transaction) is committed exactly once, or never for a parked key; every
// delivery is acked as processed, duplicate or parked, none nacked by a
// claim failure (only lease-mode copies that met the first copy's lease
// are nacked, and redelivered); one record per key; the records to keep
// survive; once traffic stops, a purge leaves no partition past retention.
func TestPartitionedChaosPurgesDuringTraffic(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	t.Logf("seed %d", seed)
	rng := mrand.New(mrand.NewPCG(seed, 0))

	cfg, err := pgxpool.ParseConfig(testenv.PgBouncer(t, "transaction"))
	require.NoError(t, err)
	cfg.MaxConns = 8
	bouncerPool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	require.NoError(t, err)
	t.Cleanup(bouncerPool.Close)
	drivers := map[string]wsql.Beginner{
		"pgxpool":      wsql.BeginnerFromPgx(testenv.Pool(t)),
		"database-sql": wsql.BeginnerFromStdSQL(testenv.StdDB(t)),
		"pgbouncer":    wsql.BeginnerFromPgx(bouncerPool),
	}
	for round := range 6 {
		t.Run(fmt.Sprint("round-", round), func(t *testing.T) {
			// A live lease keeps its partition (the purge waits for it to
			// end), so every other round has no lease-mode consumer: there
			// the partition is retired while claims are in flight into it.
			withLease := round%2 == 0
			chaosRound(t, drivers, withLease, mrand.New(mrand.NewPCG(rng.Uint64(), uint64(round))))
		})
	}
}

// chaosConsumer is one middleware of a round.
type chaosConsumer struct {
	name   string
	driver string
	mode   func(*exactlyonce.Config)
	lease  bool
	events testenv.Counters
	h      message.HandlerFunc
	// deliveries are the keys delivered, in order, with their copies.
	deliveries []string
	keys       []string
}

// permanentKey reports whether the handler fails key permanently (parked).
func permanentKey(consumer, key string) bool {
	return consumer[:3] == "tx-" && hash(key)%13 == 0
}

func hash(s string) uint32 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(s))
	return h.Sum32()
}

func chaosRound(t *testing.T, drivers map[string]wsql.Beginner, withLease bool, rng *mrand.Rand) {
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Second)
	defer cancel()
	tables := testenv.SchemaLayout(t, "partitioned")
	direct := drivers["pgxpool"]
	l := inboxpart.Layout{Schema: tables.Schema, Table: tables.InboxTable}
	exec := func(q string, args ...any) {
		t.Helper()
		_, err := direct.ExecContext(ctx, q, args...)
		require.NoError(t, err, q)
	}

	// Maintenance stopped days ago: the newest partition ended yesterday
	// at midnight; an older one is past retention.
	var now time.Time
	require.NoError(t, seam.QueryRow(ctx, direct, "SELECT now()", nil, &now))
	parts, err := l.List(ctx, direct)
	require.NoError(t, err)
	for _, p := range parts {
		exec("DROP TABLE " + l.Quoted(p.Name))
	}
	newest := l.Floor(now).AddDate(0, 0, -2)
	ancient := l.Floor(now).AddDate(0, 0, -4)
	for _, from := range []time.Time{ancient, newest} {
		exec("CREATE TABLE " + l.Quoted(l.Name(from)) + " (LIKE " + l.Parent() + " INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
		exec("ALTER TABLE " + l.Parent() + " ATTACH PARTITION " + l.Quoted(l.Name(from)) + " FOR VALUES FROM (" +
			inboxpart.Literal(from) + ") TO (" + inboxpart.Literal(from.AddDate(0, 0, 1)) + ")")
	}
	at := ancient.Add(time.Hour)
	exec("INSERT INTO "+tables.Inbox()+` (consumer, message_key, status, first_seen_at, processed_at, partition_at)
SELECT 'old', 'done-' || g, 'done', $1::timestamptz, $1::timestamptz, $1::timestamptz FROM generate_series(1, 200) g`, at)
	exec("INSERT INTO "+tables.Inbox()+` (consumer, message_key, status, first_seen_at, processed_at, partition_at, parked_by_transaction)
SELECT 'old', 'keep-' || g, CASE WHEN g % 2 = 0 THEN 'parked' ELSE 'failed' END, $1::timestamptz, $1::timestamptz, $1::timestamptz, true
FROM generate_series(1, 20) g`, at)
	effects := pgx.Identifier{tables.Schema, "effects"}.Sanitize()
	exec("CREATE TABLE " + effects + " (consumer text NOT NULL, key text NOT NULL)")

	transactional := func(*exactlyonce.Config) {}
	batch := func(c *exactlyonce.Config) {
		c.Batch = &exactlyonce.BatchConfig{MaxSize: 8, MaxWait: 2 * time.Millisecond}
	}
	lease := func(c *exactlyonce.Config) { c.Lease = &exactlyonce.LeaseConfig{} }
	consumers := []*chaosConsumer{
		{name: "tx-pgx", driver: "pgxpool", mode: transactional},
		{name: "tx-std", driver: "database-sql", mode: transactional},
		{name: "tx-bouncer", driver: "pgbouncer", mode: transactional},
		{name: "batch-pgx", driver: "pgxpool", mode: batch},
		{name: "batch-std", driver: "database-sql", mode: batch},
	}
	if withLease {
		consumers = append(consumers,
			&chaosConsumer{name: "lease-pgx", driver: "pgxpool", mode: lease, lease: true},
			&chaosConsumer{name: "lease-std", driver: "database-sql", mode: lease, lease: true})
	}
	for _, c := range consumers {
		c.h = chaosMiddleware(t, tables, drivers[c.driver], c, effects)
		for i := range 50 {
			k := fmt.Sprintf("%s-%d", c.name, i)
			c.keys = append(c.keys, k)
			c.deliveries = append(c.deliveries, k)
			for rng.IntN(3) == 0 && len(c.deliveries) < 200 {
				c.deliveries = append(c.deliveries, k) // a copy: redelivered or concurrent
			}
		}
		rng.Shuffle(len(c.deliveries), func(i, j int) { c.deliveries[i], c.deliveries[j] = c.deliveries[j], c.deliveries[i] })
	}

	// Purges run whenever traffic made progress (every 25 deliveries), so
	// the first one finds claims in flight into the newest partition.
	tick := make(chan struct{}, 1)
	stop := make(chan struct{})
	var purges, dropped atomic.Int64
	var errMu sync.Mutex
	var errs []error
	fail := func(err error) {
		errMu.Lock()
		errs = append(errs, err)
		errMu.Unlock()
	}
	// One purge at a time (two purges at once race on the partitions' DDL:
	// see TestPurgesRacing for the row purge), alternating drivers.
	var stores []*inbox.Store
	for _, d := range []string{"pgbouncer", "database-sql"} {
		store, err := inbox.NewStore(testenv.WithConn(tables, drivers[d]))
		require.NoError(t, err)
		stores = append(stores, store)
	}
	var purger sync.WaitGroup
	purger.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tick:
			}
			n, err := stores[i%2].Purge(ctx, inbox.PurgeOptions{OlderThan: time.Minute, BatchSize: 7})
			if err != nil {
				fail(fmt.Errorf("purge %d: %w", i, err))
			}
			purges.Add(1)
			dropped.Add(n)
		}
	})

	var delivered atomic.Int64
	var workers sync.WaitGroup
	for _, c := range consumers {
		for w := range 2 {
			workers.Go(func() {
				for i := w; i < len(c.deliveries); i += 2 {
					key := c.deliveries[i]
					for {
						_, err := c.h(message.NewMessage(key, nil))
						if c.lease && errors.Is(err, exactlyonce.ErrLeaseHeld) && ctx.Err() == nil {
							continue // a copy met the first one's lease: nacked, redelivered
						}
						if err != nil {
							fail(fmt.Errorf("%s: delivery of %q: %w", c.name, key, err))
						}
						break
					}
					if delivered.Add(1)%25 == 0 {
						select {
						case tick <- struct{}{}:
						default:
						}
					}
				}
			})
		}
	}
	workers.Wait()
	close(stop)
	purger.Wait()

	// Traffic stopped: the next purge retires whatever is past retention;
	// then every key is delivered once more, to a new instance of its
	// middleware, and must be a duplicate (its record survived every
	// purge: it finished within the retention).
	store, err := inbox.NewStore(tables)
	require.NoError(t, err)
	n, err := store.Purge(ctx, inbox.PurgeOptions{OlderThan: time.Minute})
	if err != nil {
		fail(fmt.Errorf("the purge after the traffic: %w", err))
	}
	dropped.Add(n)
	for _, c := range consumers {
		h := chaosMiddleware(t, tables, drivers[c.driver], c, effects)
		workers.Go(func() {
			for _, k := range c.keys {
				if _, err := h(message.NewMessage(k, nil)); err != nil {
					fail(fmt.Errorf("%s: the last redelivery of %q: %w", c.name, k, err))
				}
			}
		})
	}
	workers.Wait()
	t.Logf("%d deliveries, %d purges, %d records dropped", delivered.Load(), purges.Load()+1, dropped.Load())

	// Exactly once first: a failure there is the worst news.
	var twice []string
	for _, c := range consumers {
		for _, k := range c.keys {
			if n := testenv.Count(t, direct, "SELECT count(*) FROM "+effects+" WHERE consumer = $1 AND key = $2", c.name, k); n > 1 {
				twice = append(twice, fmt.Sprintf("%s/%s: %d effects", c.name, k, n))
			}
		}
	}
	require.Empty(t, twice, "keys processed more than once")
	require.NoError(t, errors.Join(errs...))
	require.Equal(t, int64(200), dropped.Load(), "the records past retention, and only those, were dropped")
	parts, err = l.List(ctx, direct)
	require.NoError(t, err)
	for _, p := range parts {
		require.True(t, p.To.After(now), "%s is past retention and still there", p.Name)
	}

	for _, c := range consumers {
		var processed, parked int64
		for _, k := range c.keys {
			want := int64(1)
			status := "done"
			if permanentKey(c.name, k) {
				want, status = 0, "parked"
				parked++
			} else {
				processed++
			}
			require.Equal(t, want, testenv.Count(t, direct, "SELECT count(*) FROM "+effects+" WHERE consumer = $1 AND key = $2", c.name, k),
				"%s: effects of %q", c.name, k)
			rec, err := store.Get(ctx, c.name, k)
			require.NoError(t, err, "%s: the record of %q", c.name, k)
			require.Equal(t, status, rec.Status, "%s: %q", c.name, k)
		}
		ev := &c.events
		require.Zero(t, ev.ClaimFailed.Load()+ev.DBUnavailable.Load()+ev.Failed.Load()+ev.FailOpen.Load()+ev.Rejected.Load(),
			"%s: deliveries nacked (claim failed %d, database unavailable %d, failed %d)", c.name,
			ev.ClaimFailed.Load(), ev.DBUnavailable.Load(), ev.Failed.Load())
		require.Equal(t, processed, ev.Processed.Load(), c.name)
		require.Equal(t, int64(len(c.deliveries)+len(c.keys)), ev.Processed.Load()+ev.Duplicates.Load()+ev.Parked.Load(),
			"%s: every delivery acked once", c.name)
		require.GreaterOrEqual(t, ev.Parked.Load(), parked, c.name)
	}
	require.Zero(t, testenv.Count(t, direct, "SELECT count(*) FROM (SELECT 1 FROM "+tables.Inbox()+
		" GROUP BY consumer, message_key HAVING count(*) > 1) d"), "keys with two records")
	require.Equal(t, int64(20), testenv.Count(t, direct, "SELECT count(*) FROM "+tables.Inbox()+" WHERE consumer = 'old'"),
		"the records to keep survived their partition")
}

// chaosMiddleware is c's middleware on tables through db: its handler
// writes the key's effect in the message's transaction, fails some keys
// permanently, and for some keys keeps its transaction open a moment (so
// that a purge finds claims in flight).
func chaosMiddleware(t *testing.T, tables sqlschema.DB, db wsql.Beginner, c *chaosConsumer, effects string) message.HandlerFunc {
	t.Helper()
	cfg := exactlyonce.Config{DB: testenv.WithConn(tables, db), Consumer: c.name, NackDelay: -1, OnEvent: c.events.Observe}
	c.mode(&cfg)
	cfg.Logger = watermill.NopLogger{}
	eo, err := exactlyonce.New(cfg)
	require.NoError(t, err)
	return eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		if err := testenv.Exec(ctx, "INSERT INTO "+effects+" (consumer, key) VALUES ($1, $2)", c.name, msg.UUID); err != nil {
			return nil, err
		}
		if hash(msg.UUID)%3 == 0 {
			if err := testenv.Exec(ctx, "SELECT pg_sleep(0.003)"); err != nil {
				return nil, err
			}
		}
		if permanentKey(c.name, msg.UUID) {
			return nil, exactlyonce.Permanent(errors.New("cannot ever work"))
		}
		return nil, nil
	})
}
