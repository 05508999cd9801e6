package cluster_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// failoverRun is one failover run: a replication setting, the
// middleware's mode, and whether the standby's WAL stalls before the crash.
type failoverRun struct {
	replication string // "async", "on", "remote_apply"
	batch       bool   // group commit, else one transaction per message
	stall       bool   // the primary's WAL sender is stopped ~1 s before the crash
	messages    int
}

// failoverKeys is the number of ordering keys of the outputs.
const failoverKeys = 20

// failoverRate is how many inputs a second are published.
const failoverRate = 200

// failoverFigures is what a run measured.
type failoverFigures struct {
	messages int
	// From the promoted node (b).
	effects      int // distinct inputs with an effect row
	lost         int // inputs without an effect row
	duplicates   int // inputs with more than one effect row
	undelivered  int // effects on b whose output never reached downstream
	repeated     int // outputs delivered more than once
	quarantined  int64
	lostOutputs  int // outputs of lost effects delivered downstream anyway (relayed from a before the crash)
	orderBreaks  int // per key, first deliveries of b's outputs not in b's commit order
	onlyOnA      int // inputs with an effect on the crashed primary (restarted alone) but not on b
	nowhere      int // lost inputs with an effect on neither node
	recovery     time.Duration
	crashAtCount int // effects counted when the crash began
}

// runFailover publishes run.messages messages to a RabbitMQ queue of the
// single node, consumes them with a Watermill router whose middleware
// writes through the pair's multi-host URL (each handler: one effect row,
// no unique constraint, and one outbox message), relays the outbox to an
// output queue (the relay's LISTEN through the same URL), counts the
// outputs downstream in memory, crashes the primary once a third of the
// effects are in, promotes the standby, and lets everything go on by
// itself. It returns the figures, read from the promoted node and then
// from the crashed primary restarted alone.
func runFailover(t *testing.T, run failoverRun) failoverFigures {
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	p := pgPair(t)
	require.NoError(t, p.SetReplication(ctx, "a", run.replication))

	pcfg, err := pgxpool.ParseConfig(p.URL() + "&connect_timeout=2")
	require.NoError(t, err)
	pcfg.MaxConns = 20
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	require.NoError(t, err)
	defer pool.Close()
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: "fo"}
	require.NoError(t, sqlschema.Migrate(ctx, db))
	db = db.WithDefaults()
	_, err = pool.Exec(ctx, `CREATE TABLE fo.effects (msg_id text NOT NULL, okey text NOT NULL, seq bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE SEQUENCE fo.seq CACHE 1`)
	require.NoError(t, err)

	in := testenv.Queue(t, "fo_in_")
	out := testenv.Queue(t, "fo_out_")

	// Downstream: counts deliveries per output, and keeps each key's
	// outputs in the order they arrived.
	var dmu sync.Mutex
	delivered := map[string]int{}
	arrivals := map[string][]string{} // ordering key -> input ids, in arrival order
	downCtx, downCancel := context.WithCancel(ctx)
	defer downCancel()
	downSub := testenv.AMQPSubscriber(t, 200)
	outputs, err := downSub.Subscribe(downCtx, out)
	require.NoError(t, err)
	var downWG sync.WaitGroup
	downWG.Go(func() {
		for m := range outputs {
			dmu.Lock()
			id := m.Metadata.Get("input")
			delivered[id]++
			k := msgid.OrderingKey(m)
			arrivals[k] = append(arrivals[k], id)
			dmu.Unlock()
			m.Ack()
		}
	})

	// The relay: the multi-host URL, LISTEN too.
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: testenv.AMQPPublisher(t),
		ErrorBackoff: 100 * time.Millisecond, MaxErrorBackoff: time.Second, PollInterval: 500 * time.Millisecond,
		Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	relayCtx, relayCancel := context.WithCancel(ctx)
	var relayWG sync.WaitGroup
	relayWG.Go(func() { _ = relay.Run(relayCtx) })
	defer func() { relayCancel(); relayWG.Wait() }()

	// The consumers.
	var acked sync.Map // input id -> true once the middleware acked it
	var ackedN atomic.Int64
	cfg := exactlyonce.Config{DB: db, Consumer: "fo", NackDelay: 100 * time.Millisecond, Logger: watermill.NopLogger{},
		OnEvent: func(e exactlyonce.Event) {
			if e.Err == nil && (e.Outcome == exactlyonce.Processed || e.Outcome == exactlyonce.Duplicate) {
				if _, loaded := acked.LoadOrStore(e.MessageUUID, true); !loaded {
					ackedN.Add(1)
				}
			}
		}}
	if run.batch {
		cfg.Batch = &exactlyonce.BatchConfig{MaxSize: 16}
	}
	eo, err := exactlyonce.New(cfg)
	require.NoError(t, err)
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, watermill.NopLogger{})
	require.NoError(t, err)
	r.AddMiddleware(eo.Middleware)
	r.AddConsumerHandler("fo", in, exactlyonce.ConcurrentSubscriber(testenv.AMQPSubscriber(t, 64), 16), func(msg *message.Message) error {
		tx, err := exactlyonce.PgxTxFromContext(msg.Context())
		if err != nil {
			return err
		}
		key := msg.Metadata.Get("okey")
		// The key's lock makes its outputs' seq follow its commits.
		if _, err := tx.Exec(msg.Context(), "SELECT pg_advisory_xact_lock(hashtext($1))", key); err != nil {
			return err
		}
		var seq int64
		if err := tx.QueryRow(msg.Context(), "INSERT INTO fo.effects (msg_id, okey, seq) VALUES ($1, $2, nextval('fo.seq')) RETURNING seq",
			msg.UUID, key).Scan(&seq); err != nil {
			return err
		}
		ob, err := exactlyonce.OutboxFromContext(msg.Context())
		if err != nil {
			return err
		}
		o := message.NewMessage("out-"+msg.UUID, []byte(strconv.FormatInt(seq, 10)))
		o.Metadata.Set("input", msg.UUID)
		msgid.SetOrderingKey(o, key)
		return ob.Publish(out, o)
	})
	routerCtx, routerCancel := context.WithCancel(ctx)
	routerDone := make(chan struct{})
	go func() { defer close(routerDone); _ = r.Run(routerCtx) }()
	defer func() { routerCancel(); <-routerDone }()
	<-r.Running()

	// The inputs arrive at a steady pace (failoverRate a second), before,
	// during and after the failover.
	pub := testenv.AMQPPublisher(t)
	pubErr := make(chan error, 1)
	go func() {
		tick := time.NewTicker(time.Second / failoverRate)
		defer tick.Stop()
		for i := range run.messages {
			m := message.NewMessage(fmt.Sprintf("in-%05d", i), nil)
			m.Metadata.Set("okey", fmt.Sprintf("k%02d", i%failoverKeys))
			if err := pub.Publish(in, m); err != nil {
				pubErr <- err
				return
			}
			select {
			case <-tick.C:
			case <-ctx.Done():
				pubErr <- ctx.Err()
				return
			}
		}
		pubErr <- nil
	}()

	// Watch the primary directly until a third of the effects are in.
	a, err := pgx.Connect(ctx, p.NodeURL("a"))
	require.NoError(t, err)
	var crashCount int
	testenv.Eventually(t, 2*time.Minute, func() bool {
		err := a.QueryRow(ctx, "SELECT count(*) FROM fo.effects").Scan(&crashCount)
		return err == nil && crashCount >= run.messages/3
	}, "a third of the effects committed on the primary")
	if run.stall {
		stallWALSender(t, ctx, a)
	}
	_ = a.Close(ctx)
	crashAt := time.Now()
	if run.stall {
		crashWithStalledSender(t, p)
	} else {
		require.NoError(t, p.Crash("a"))
	}
	promoting := time.Now()
	require.NoError(t, p.Promote("b"))
	promoted := time.Now()

	// Everything goes on by itself: every input is acked once, and the
	// outbox empties.
	require.NoError(t, <-pubErr)
	testenv.Eventually(t, 2*time.Minute, func() bool { return ackedN.Load() >= int64(run.messages) },
		"every input acked after the failover")
	b, err := pgx.Connect(ctx, p.NodeURL("b"))
	require.NoError(t, err)
	defer func() { _ = b.Close(ctx) }()
	testenv.Eventually(t, time.Minute, func() bool {
		var n int
		return b.QueryRow(ctx, "SELECT count(*) FROM "+db.Outbox()+" WHERE quarantined_at IS NULL").Scan(&n) == nil && n == 0
	}, "the outbox drained on the promoted node")

	// Figures from the promoted node.
	f := failoverFigures{messages: run.messages, crashAtCount: crashCount}
	onB := map[string]int{}
	seqOnB := map[string]int64{}
	rows, err := b.Query(ctx, "SELECT msg_id, seq FROM fo.effects")
	require.NoError(t, err)
	for rows.Next() {
		var id string
		var seq int64
		require.NoError(t, rows.Scan(&id, &seq))
		onB[id]++
		seqOnB[id] = seq
	}
	require.NoError(t, rows.Err())
	var first, maxAt time.Time
	require.NoError(t, b.QueryRow(ctx, "SELECT coalesce(min(at) FILTER (WHERE at > $1), 'epoch'), max(at) FROM fo.effects", promoting).Scan(&first, &maxAt))
	t.Logf("crash %s, promote %s..%s, first effect after %s, last %s", crashAt.Format(time.StampMicro), promoting.Format(time.StampMicro),
		promoted.Format(time.StampMicro), first.Format(time.StampMicro), maxAt.Format(time.StampMicro))
	if first.After(crashAt) {
		f.recovery = first.Sub(crashAt)
	}
	require.NoError(t, b.QueryRow(ctx, "SELECT count(*) FROM "+db.Outbox()+" WHERE quarantined_at IS NOT NULL").Scan(&f.quarantined))

	// Downstream: wait until every effect on b has its output (or a
	// minute passed: then it counts as undelivered).
	_ = waitUntil(30*time.Second, func() bool {
		dmu.Lock()
		defer dmu.Unlock()
		for id := range onB {
			if delivered[id] == 0 {
				return false
			}
		}
		return true
	})
	routerCancel()
	<-routerDone
	relayCancel()
	relayWG.Wait()
	downCancel()
	downWG.Wait()
	pool.Close()

	dmu.Lock()
	for i := range run.messages {
		id := fmt.Sprintf("in-%05d", i)
		n := onB[id]
		switch {
		case n == 0:
			f.lost++
			if delivered[id] > 0 {
				f.lostOutputs++
			}
		case n > 1:
			f.duplicates++
		}
		if n > 0 {
			f.effects++
			if delivered[id] == 0 {
				f.undelivered++
			}
		}
		if delivered[id] > 1 {
			f.repeated++
		}
	}
	// Order: per key, the first deliveries of b's outputs follow b's seq.
	for _, ids := range arrivals {
		seen := map[string]bool{}
		var last int64 = -1
		for _, id := range ids {
			seq, ok := seqOnB[id]
			if !ok || seen[id] {
				continue
			}
			seen[id] = true
			if seq < last {
				f.orderBreaks++
			}
			last = max(last, seq)
		}
	}
	dmu.Unlock()

	// The crashed primary, restarted alone (b and a are two primaries
	// now: nothing of the test reaches a but this).
	startNodeAlone(t, "a")
	a, err = pgx.Connect(ctx, p.NodeURL("a"))
	require.NoError(t, err)
	defer func() { _ = a.Close(ctx) }()
	onA := map[string]bool{}
	rows, err = a.Query(ctx, "SELECT msg_id FROM fo.effects")
	require.NoError(t, err)
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		onA[id] = true
	}
	require.NoError(t, rows.Err())
	for i := range run.messages {
		id := fmt.Sprintf("in-%05d", i)
		if onB[id] == 0 {
			if onA[id] {
				f.onlyOnA++
			} else {
				f.nowhere++
			}
		}
	}
	return f
}

// logFigures logs a run's figures as a table row.
func logFigures(t *testing.T, name string, f failoverFigures) {
	t.Helper()
	t.Logf("| %-28s | %5d | %4d | %4d | %4d | %4d | %4d | %4d | %4d | %4d | %7s |", name, f.messages, f.lost, f.duplicates,
		f.undelivered, f.repeated, f.quarantined, f.lostOutputs, f.onlyOnA, f.orderBreaks, f.recovery.Round(10*time.Millisecond))
	t.Logf("  (columns: run | messages | lost effects | duplicate effects | undelivered outputs | repeated deliveries | quarantined | outputs of lost effects delivered | lost effects found on the crashed primary | per-key order breaks | time to recover; crash at %d effects)", f.crashAtCount)
}

func waitUntil(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// walSenderPID is the process id of the primary's WAL sender to the standby.
func walSenderPID(t *testing.T, ctx context.Context, primary *pgx.Conn) int {
	t.Helper()
	var pid int
	require.NoError(t, primary.QueryRow(ctx, "SELECT pid FROM pg_stat_replication WHERE application_name = 'eo_standby'").Scan(&pid))
	return pid
}

// stalledSender is the WAL sender stallWALSender stopped.
var stalledSender atomic.Int64

// stallWALSender stops (SIGSTOP) the primary's WAL sender for a second:
// meanwhile the primary commits (asynchronous replication does not wait),
// and nothing of it reaches the standby. What the sender had written to
// its socket before is received; nothing after.
func stallWALSender(t *testing.T, ctx context.Context, primary *pgx.Conn) {
	t.Helper()
	pid := walSenderPID(t, ctx, primary)
	require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
	stalledSender.Store(int64(pid))
	time.Sleep(time.Second)
}

// crashWithStalledSender crashes node a whose WAL sender is stopped: the
// immediate stop (pg_ctl stop -m immediate) signals every process, and
// the stopped sender is killed (SIGKILL works on a stopped process), so
// that it never sends what it had not sent.
func crashWithStalledSender(t *testing.T, p *testenv.PGPair) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- p.Crash("a") }()
	time.Sleep(100 * time.Millisecond)
	pid := int(stalledSender.Load())
	if err := syscall.Kill(pid, syscall.SIGKILL); err != nil && !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("killing the stopped WAL sender %d: %v", pid, err)
	}
	require.NoError(t, <-done)
}

// pairDir is scripts/pg-pair.sh's data directory.
func pairDir() string {
	if d := os.Getenv("EO_PGPAIR_DIR"); d != "" {
		return d
	}
	base := 5440
	if v, err := strconv.Atoi(os.Getenv("EO_PGPAIR_PORT_BASE")); err == nil && v > 0 {
		base = v
	}
	return fmt.Sprintf("/tmp/eo-pg-pair-%d", base)
}

// startNodeAlone starts a crashed node of the pair again, by itself (not
// as a standby: it recovers what its own WAL has and takes writes), to
// read what it had committed. pgPair's cleanup stops it.
func startNodeAlone(t *testing.T, n string) {
	t.Helper()
	versions, err := filepath.Glob("/usr/lib/postgresql/*/bin/pg_ctl")
	require.NoError(t, err)
	require.NotEmpty(t, versions)
	sort.Strings(versions)
	pgctl := versions[len(versions)-1]
	if v := os.Getenv("EO_PG_VERSION"); v != "" {
		pgctl = "/usr/lib/postgresql/" + v + "/bin/pg_ctl"
	}
	dir := pairDir()
	args := []string{pgctl, "-D", filepath.Join(dir, n), "-l", filepath.Join(dir, n+".log"), "-w", "start"}
	if os.Getuid() == 0 {
		args = append([]string{"runuser", "-u", "postgres", "--"}, args...)
	}
	outb, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	require.NoError(t, err, "starting node %s alone: %s", n, outb)
}
