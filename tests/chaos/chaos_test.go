package chaos

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// TestChaos runs the chaos suite once per run of CHAOS_MODES (sequentially:
// each run takes the machine's CPU). Environment:
//
//	CHAOS_MESSAGES   unique messages (default 800; a MariaDB run 500)
//	CHAOS_DUP_RATIO  extra copies per unique message (default 0.2)
//	CHAOS_FAULTS     at least this many faults of each kind (default 3; a
//	                 MariaDB run 2)
//	CHAOS_MODES      comma-separated runs, each a mode (transactional, lease,
//	                 or batch: transactional with group commit, Config.Batch)
//	                 with an optional database setup: @repeatable-read (the
//	                 workers' role defaults to REPEATABLE READ) or
//	                 @pgbouncer (through PgBouncer in transaction pooling),
//	                 or, for lease mode only, @redis (lease@redis: the
//	                 consumers keep lease records in Redis with redisstore,
//	                 reached through a proxy whose connections are cut; the
//	                 handler only calls the provider, so no relay and no
//	                 downstream run), or on MariaDB: @mariadb (its default
//	                 REPEATABLE READ) or @mariadb-rc (the workers' sessions
//	                 default to READ COMMITTED: tx_isolation in their DSN);
//	                 there a fresh database per run, every worker on
//	                 go-sql-driver/mysql through the proxy, and KILL of
//	                 their connections for pg_terminate_backend. A mode may
//	                 name the consumers' subscriber after a +: batch+rabbitmq
//	                 or transactional+rabbitmq run one handler on
//	                 rabbitmq.Subscriber (one subscription, prefetch 16,
//	                 acks batched) instead of watermill-amqp's;
//	                 batch+cluster or transactional+cluster the same on a
//	                 three-node RabbitMQ cluster (cluster_test.go): quorum
//	                 queues, the relay on rabbitmq.Publisher and the
//	                 consumers and downstream on rabbitmq.Subscriber, each
//	                 given the three nodes in an order of its own, and the
//	                 nodes' faults on top of the others (a MariaDB setup may
//	                 follow: batch+cluster@mariadb-rc).
//	                 Default: transactional,lease,batch,lease@repeatable-read,
//	                 transactional@pgbouncer,lease@redis,
//	                 batch+rabbitmq@repeatable-read,
//	                 transactional+rabbitmq@pgbouncer,transactional@mariadb,
//	                 batch@mariadb-rc,lease@mariadb.
//	CHAOS_CLUSTER_FAULTS  a cluster run's rounds of node SIGKILLs (each node
//	                 in turn, restarted before the next: the leader of the
//	                 queues first, then the relay's node) and majorities
//	                 lost (two nodes down for 10 s), each; unset: one of
//	                 each in the compact schedule (see clusterChaos), and a
//	                 cluster run is 400 messages with 1 fault of each other
//	                 kind unless CHAOS_MESSAGES and CHAOS_FAULTS say
//	                 otherwise. The cluster (nodes eo-chaos1..3 on
//	                 127.0.0.1:5701..5703; EO_RMQ_PORT_BASE and EO_RMQ_NAME
//	                 move it) is started by the package when a cluster run
//	                 is selected and stopped at the end (EO_CLUSTER_KEEP=1
//	                 keeps it).
//	CHAOS_SEED       seed of the plan (faulty keys, copies, fault schedule);
//	                 default from the clock, logged. Process timing is not
//	                 reproducible; the plan is.
//	CHAOS_SETTLE     bound of the wait for the system to settle after the
//	                 faults (default 2m)
//
// Each run: a fresh schema and queues; PostgreSQL and RabbitMQ behind TCP
// proxies; 3 consumer processes (4 handlers each, prefetch 10; in batch mode
// one handler with 16 deliveries in flight; with +rabbitmq one handler on
// rabbitmq.Subscriber, prefetch 16; drivers
// pgxpool, database/sql, pgxpool; on MariaDB go-sql-driver/mysql), 1 relay
// (database/sql), 1 downstream consumer (pgxpool). The harness publishes the messages with duplicates
// spread over the fault schedule, injects the faults, waits until every key
// is done downstream and the queues are empty, stops the workers
// gracefully, and checks the invariants, printed as one table (also written
// to $TMPDIR/chaos-<mode>-seed<seed>.txt).
func TestChaos(t *testing.T) {
	s := readSettings(t)
	t.Logf("chaos: %d messages, dup ratio %.2f, >= %d faults of each kind, runs %v, seed %d (replay the plan with CHAOS_SEED=%d)",
		s.Messages, s.DupRatio, s.Faults, s.Runs, s.Seed, s.Seed)
	bin := buildWorker(t)
	for _, v := range s.Runs {
		t.Run(v.String(), func(t *testing.T) {
			// One random stream per run, whatever CHAOS_MODES holds, so
			// that CHAOS_SEED with one run replays that run's plan.
			stream := uint64(1)
			for _, c := range v.String() {
				stream = stream*31 + uint64(c)
			}
			runChaos(t, s.forRun(v), bin, v, stream)
		})
	}
}

// harness is one chaos run (one mode).
type harness struct {
	t      *testing.T
	s      settings
	mode   string
	v      variant
	rng    *mrand.Rand
	runID  string
	bin    string
	logDir string

	tables             sqlschema.DB // its Conn is pool (PostgreSQL) or my (MariaDB)
	outbox             *outbox.Writer
	pool               *pgxpool.Pool // PostgreSQL runs
	my                 *sql.DB       // MariaDB runs (@mariadb, @mariadb-rc)
	conn               *amqp.Connection
	in, out, out2      string
	outB               string // the other output queue: outputs alternate between out and outB
	ticks              string // healthy events written during the settle (see trickle)
	ticksSent          int
	dbProxy, amqpProxy *testenv.Proxy
	relayAMQPProxy     *testenv.Proxy // the relay's own, for outages mid-batch
	bouncer            *testenv.PgBouncerSupervisor
	redis              *redis.Client  // lease@redis: the harness's own client
	redisProxy         *testenv.Proxy // lease@redis: the workers' way to Redis
	redisPrefix        string         // lease@redis: the run's key prefix
	redisCut           int64          // lease@redis: Redis connections cut
	workerDBURL        string         // what the workers dial (before the proxy or PgBouncer)
	provider           *testenv.Provider
	sink               *sink

	// A cluster run's: the cluster, the node faults, each process's ways
	// to the nodes, and the input copies published again after a node
	// fault.
	rabbit                *testenv.RabbitCluster
	cc                    *clusterChaos
	consumerLinks         []*nodeLinks
	relayLinks, downLinks *nodeLinks
	republished           atomic.Int64

	consumers          []*proc
	relay, downstream  *proc
	keys               []string
	plan               map[string]string
	plannedFaults      map[string]int
	copies             []copyRec
	published          atomic.Int64
	injected           map[string]int
	terminated         int64 // backends terminated (MariaDB: connections KILLed)
	amqpCut            int64 // AMQP connections cut
	exitMu             sync.Mutex
	exits              []string
	gracefulStopFailed []string
}

func (h *harness) lease() bool { return h.mode == "lease" }

func (h *harness) table(name string) string {
	return h.tables.Dialect.QuoteIdentifier(h.tables.Schema, name)
}

func runChaos(t *testing.T, s settings, bin string, v variant, stream uint64) {
	mode := v.Mode
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	t.Cleanup(cancel)
	idBytes := make([]byte, 4)
	_, _ = rand.Read(idBytes)
	h := &harness{
		t: t, s: s, mode: mode, v: v, bin: bin,
		rng:      mrand.New(mrand.NewPCG(s.Seed, stream)),
		runID:    hex.EncodeToString(idBytes),
		injected: map[string]int{},
	}
	var err error
	h.logDir, err = os.MkdirTemp("", "chaos-"+mode+"-*")
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() || os.Getenv("CHAOS_KEEP_LOGS") != "" {
			t.Logf("worker logs kept in %s", h.logDir)
			return
		}
		_ = os.RemoveAll(h.logDir)
	})

	if v.mysql() {
		h.setupMySQL(ctx)
	} else {
		h.pool = testenv.Pool(t)
		h.tables = testenv.WithConn(testenv.Schema(t), wsql.BeginnerFromPgx(h.pool))
		_, err = h.pool.Exec(ctx, `CREATE TABLE `+h.table("effects")+` (id bigserial PRIMARY KEY, key text NOT NULL,
attempt int NOT NULL, worker text NOT NULL, out_uuid text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp(),
txid bigint NOT NULL DEFAULT txid_current());
CREATE TABLE `+h.table("down_effects")+` (id bigserial PRIMARY KEY, key text NOT NULL, uuid text NOT NULL,
worker text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`)
		require.NoError(t, err)
	}
	h.outbox, err = outbox.NewWriter(h.tables)
	require.NoError(t, err)
	if v.cluster() {
		// Quorum queues, their leaders spread over the nodes.
		h.rabbit = rabbitCluster(t)
		h.in, h.out, h.outB = testenv.Unique(t, "chaos_in_"), testenv.Unique(t, "chaos_out_"), testenv.Unique(t, "chaos_outb_")
		h.out2, h.ticks = testenv.Unique(t, "chaos_out2_"), testenv.Unique(t, "chaos_ticks_")
		clusterQueues(t, h.rabbit, []string{h.in, h.out, h.outB, h.out2, h.ticks}, false)
		h.conn, err = dialCluster(ctx, h.rabbit, 1)
		require.NoError(t, err)
		t.Cleanup(func() { _ = h.conn.Close() })
	} else {
		h.in = testenv.Queue(t, "chaos_in_")
		h.out = testenv.Queue(t, "chaos_out_")
		h.outB = testenv.Queue(t, "chaos_outb_")
		h.out2 = testenv.Queue(t, "chaos_out2_")
		h.ticks = testenv.Queue(t, "chaos_ticks_")
		h.conn = testenv.AMQPConn(t)
	}
	if v.mysql() {
		h.dbProxy = testenv.NewProxy(t, hostPort(t, testenv.MySQLURL(), "3306"))
	} else {
		h.dbProxy = testenv.NewProxy(t, hostPort(t, testenv.DatabaseURL(), "5432"))
	}
	h.amqpProxy = testenv.NewProxy(t, hostPort(t, testenv.AMQPURL(), "5672"))
	h.relayAMQPProxy = testenv.NewProxy(t, hostPort(t, testenv.AMQPURL(), "5672"))
	switch v.DB {
	case dbDirect:
		h.workerDBURL = h.dbProxy.RewriteURL(testenv.DatabaseURL())
	case dbRepeatableRead:
		h.workerDBURL = h.dbProxy.RewriteURL(testenv.DatabaseURLWithIsolation(t, testenv.RepeatableRead))
		var iso string
		require.NoError(t, h.pool.QueryRow(ctx, `SELECT s.setconfig::text FROM pg_db_role_setting s JOIN pg_roles r ON r.oid = s.setrole
WHERE r.rolname = $1`, roleOf(t, h.workerDBURL)).Scan(&iso))
		require.Contains(t, iso, "repeatable read", "the workers' role defaults to REPEATABLE READ")
	case dbRedis:
		h.workerDBURL = h.dbProxy.RewriteURL(testenv.DatabaseURL()) // unused by the consumers
		h.redis = testenv.Redis(t)
		h.redisPrefix = testenv.RedisPrefix(t, h.redis)
		h.redisProxy = testenv.NewProxy(t, hostPort(t, testenv.RedisURL(), "6379"))
	case dbMariaDB, dbMariaDBRC:
		h.workerDBURL = h.mysqlWorkerURL(ctx)
	case dbPgBouncer:
		h.bouncer = &testenv.PgBouncerSupervisor{}
		// PgBouncer's server connections go through the proxy, so that the
		// database faults reach them; the workers dial PgBouncer.
		h.workerDBURL = testenv.StartPgBouncer(t, testenv.PgBouncerConfig{
			PoolMode: "transaction", PoolSize: 8, TargetURL: h.dbProxy.RewriteURL(testenv.DatabaseURL()),
			// After the proxy refused, log in again within a second, not 15.
			ServerLoginRetry: 1,
			// PgBouncer 1.18 sometimes crashes on a client's cancel request
			// ("disconnect_client(): bad client state"): restarted, and
			// reported as one more fault survived.
			Supervise: h.bouncer,
		})
	}
	if h.lease() {
		h.provider = testenv.NewProvider(t)
		// An SMS API takes a little while to answer.
		h.provider.SetOnRequest(func(r *http.Request, _ string, _ int) int {
			select {
			case <-r.Context().Done():
			case <-time.After(10 * time.Millisecond):
			}
			return http.StatusOK
		})
	}
	h.planInput()
	steps, planned := h.planFaults()
	h.sink = newSink(t, h.plan)
	t.Logf("%s: %d copies of %d messages; planned handler faults %v; %d scheduled faults over ~%s; run id %s",
		mode, len(h.copies), s.Messages, h.plannedFaults, len(steps), planned.Round(time.Second), h.runID)

	h.startWorkers()

	// Publish over most of the fault schedule, and inject.
	window := max(3*time.Second, planned*8/10)
	pubCtx, pubCancel := context.WithCancel(ctx)
	pubDone := make(chan struct{})
	var pubErr error
	pubConn := h.conn
	if v.cluster() {
		pubConn = nil // publish connects to the nodes itself
	}
	go func() {
		defer close(pubDone)
		pubErr = h.publish(pubCtx, pubConn, window)
	}()
	defer func() {
		pubCancel()
		<-pubDone
	}()
	faultStart := time.Now()
	for _, st := range steps {
		h.inject(ctx, st)
	}
	faultTime := time.Since(faultStart)
	select {
	case <-pubDone:
		require.NoError(t, pubErr, "publishing")
	case <-time.After(window + time.Minute):
		t.Fatal("publishing did not finish")
	}

	// Settle: every key done downstream, outbox and queues empty.
	settleStart := time.Now()
	settled := h.awaitSettled(ctx)
	settleTime := time.Since(settleStart)
	h.stopWorkers()
	leftIn, badIn, leftOut, badOut := h.leftovers(ctx)
	left2, _, err := queueState(h.amqpConn(), h.out2)
	require.NoError(t, err)

	tb := h.invariants(ctx, settled, leftIn, badIn, leftOut, badOut, left2)
	tb.info("timings", fmt.Sprintf("faults %s, settle %s, total %s", faultTime.Round(time.Millisecond),
		settleTime.Round(time.Millisecond), time.Since(start).Round(time.Millisecond)))
	text := tb.String()
	t.Log("\n" + text)
	if testing.Verbose() {
		fmt.Println(text)
	}
	path := filepath.Join(os.TempDir(), fmt.Sprintf("chaos-%s-seed%d.txt", strings.ReplaceAll(v.String(), "@", "-"), s.Seed))
	if err := os.WriteFile(path, []byte(text), 0o644); err == nil {
		t.Logf("table written to %s", path)
	}
	if failed := tb.failed(); len(failed) > 0 {
		for _, p := range h.procs() {
			t.Logf("%s", p.tailLast(3, 25))
		}
		require.Empty(t, failed, "chaos invariants broken (run %s, seed %d, replay with CHAOS_SEED=%d CHAOS_MODES=%s CHAOS_MESSAGES=%d CHAOS_FAULTS=%d)",
			v, s.Seed, s.Seed, v, s.Messages, s.Faults)
	}
}

func hostPort(t *testing.T, rawURL, defPort string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	require.NoError(t, err)
	if u.Port() == "" {
		return net.JoinHostPort(u.Hostname(), defPort)
	}
	return u.Host
}

// startWorkers starts the consumers, the relay and the downstream consumer,
// and registers their killing at cleanup (before the proxies, the provider
// and the sink close).
func (h *harness) startWorkers() {
	t := h.t
	dbURL := func(role string) string {
		if h.v.mysql() {
			// MySQL has no application_name (an unknown DSN parameter is a
			// system variable to SET): the harness finds the workers'
			// connections by their database (killMySQL).
			return h.workerDBURL
		}
		u, err := url.Parse(h.workerDBURL)
		require.NoError(t, err)
		q := u.Query()
		q.Set("application_name", "chaos-"+role+"-"+h.runID)
		u.RawQuery = q.Encode()
		return u.String()
	}
	slow := h.s.SlowTx
	if h.lease() {
		slow = h.s.SlowLease
	}
	common := map[string]string{
		"CHAOS_MODE":               h.mode,
		"CHAOS_AMQP_URL":           h.amqpProxy.RewriteURL(testenv.AMQPURL()),
		"CHAOS_SCHEMA":             h.tables.Schema,
		"CHAOS_IN":                 h.in,
		"CHAOS_OUT":                h.out,
		"CHAOS_OUT_B":              h.outB,
		"CHAOS_OUT2":               h.out2,
		"CHAOS_RELAY_MAX_ATTEMPTS": strconv.Itoa(h.s.RelayMaxAttempts),
		"CHAOS_SINK_URL":           h.sink.srv.URL,
		"CHAOS_LEASE":              h.s.Lease.String(),
		"CHAOS_SLOW":               slow.String(),
		"CHAOS_PREFETCH":           strconv.Itoa(h.s.Prefetch),
	}
	if h.lease() {
		common["CHAOS_PROVIDER_URL"] = h.provider.URL()
	}
	if h.v.Subscriber != "" {
		common["CHAOS_SUBSCRIBER"] = h.v.Subscriber
	}
	if h.v.DB == dbRedis {
		common["CHAOS_STORE"] = "redis"
		common["CHAOS_REDIS_URL"] = h.redisProxy.RewriteURL(testenv.RedisURL())
		common["CHAOS_REDIS_PREFIX"] = h.redisPrefix
	}
	env := func(role, driver string, handlers int) map[string]string {
		e := map[string]string{"CHAOS_ROLE": role, "CHAOS_DB_URL": dbURL(role), "CHAOS_DRIVER": driver,
			"CHAOS_HANDLERS": strconv.Itoa(handlers)}
		for k, v := range common {
			e[k] = v
		}
		return e
	}
	// onCluster points a process of a cluster run at the three nodes,
	// through proxies of its own, from node first on.
	onCluster := func(e map[string]string, first int) *nodeLinks {
		l := newNodeLinks(t, h.rabbit)
		urls := l.urls(first)
		e["CHAOS_AMQP_URL"], e["CHAOS_AMQP_URLS"] = urls[0], strings.Join(urls[1:], ",")
		return l
	}
	for i := range h.s.Consumers {
		driver := "pgxpool"
		if i%2 == 1 {
			driver = "database-sql"
		}
		if h.v.mysql() {
			driver = "mysql"
		}
		e := env("consumer", driver, h.s.Handlers)
		if h.v.cluster() {
			h.consumerLinks = append(h.consumerLinks, onCluster(e, i%3+1))
		}
		h.consumers = append(h.consumers, h.newProc(fmt.Sprintf("consumer-%d", i), e))
	}
	if h.v.DB != dbRedis { // lease@redis: no outbox, so no relay and no downstream
		relayDriver, downDriver := "database-sql", "pgxpool"
		if h.v.mysql() {
			relayDriver, downDriver = "mysql", "mysql"
		}
		relayEnv := env("relay", relayDriver, 1)
		relayEnv["CHAOS_AMQP_URL"] = h.relayAMQPProxy.RewriteURL(testenv.AMQPURL())
		downEnv := env("downstream", downDriver, 2)
		if h.v.cluster() {
			h.relayLinks, h.downLinks = onCluster(relayEnv, 2), onCluster(downEnv, 3)
			h.cc = &clusterChaos{t: t, c: h.rabbit, compact: !h.s.clusterFaultsSet, relays: []*nodeLinks{h.relayLinks}, consumers: h.consumerLinks,
				// The leader of the input queue (the busiest) opens a round.
				leader: func() int { return leaderByQueues(t, h.rabbit, h.in) }}
		}
		h.relay = h.newProc("relay", relayEnv)
		h.downstream = h.newProc("downstream", downEnv)
	}
	t.Cleanup(func() {
		for _, p := range h.procs() {
			if !p.exited() {
				p.signal(syscall.SIGKILL, 10*time.Second)
			}
		}
	})
	for _, p := range h.procs() {
		p.start()
	}
}

// stopWorkers stops every worker gracefully, consumers first.
func (h *harness) stopWorkers() {
	var wg sync.WaitGroup
	var mu sync.Mutex
	stop := func(ps ...*proc) {
		for _, p := range ps {
			wg.Go(func() {
				if !p.stop() {
					mu.Lock()
					h.gracefulStopFailed = append(h.gracefulStopFailed, p.name)
					mu.Unlock()
				}
			})
		}
		wg.Wait()
	}
	stop(h.consumers...)
	stop(h.procs()[len(h.consumers):]...)
}

// state is what the harness polls while the system settles.
type state struct {
	consumer    map[string]int64 // inbox rows by status
	downDone    int64
	outbox      int64 // pending outbox rows, quarantined ones excluded
	quarantined int64
	inReady     int
	outReady    int
	downEffect  int64
}

func (s state) String() string {
	return fmt.Sprintf("consumer inbox %v, downstream done %d, downstream effects %d, outbox %d (+%d quarantined), ready in/out %d/%d",
		s.consumer, s.downDone, s.downEffect, s.outbox, s.quarantined, s.inReady, s.outReady)
}

func (h *harness) state(ctx context.Context) (state, error) {
	if h.v.DB == dbRedis {
		return h.redisState(ctx)
	}
	st := state{consumer: map[string]int64{}}
	err := h.each(ctx, h.q(`SELECT status, count(*) FROM `+h.tables.Inbox()+` WHERE consumer = $1 GROUP BY status`,
		`SELECT status, count(*) FROM `+h.tables.Inbox()+` WHERE consumer = ? GROUP BY status`), []any{consumerName},
		func(scan func(...any) error) error {
			var status string
			var n int64
			if err := scan(&status, &n); err != nil {
				return err
			}
			st.consumer[status] = n
			return nil
		})
	if err != nil {
		return st, err
	}
	if err := h.queryRow(ctx, h.q(`SELECT count(*) FROM `+h.tables.Inbox()+` WHERE consumer = $1 AND status = 'done'`,
		`SELECT count(*) FROM `+h.tables.Inbox()+` WHERE consumer = ? AND status = 'done'`),
		downstreamName).Scan(&st.downDone); err != nil {
		return st, err
	}
	if err := h.queryRow(ctx, `SELECT count(*) FROM `+h.table("down_effects")).Scan(&st.downEffect); err != nil {
		return st, err
	}
	p, err := testenv.OutboxStore(h.t, h.tables).Pending(ctx)
	if err != nil {
		return st, err
	}
	st.outbox = p.Count - p.Quarantined
	st.quarantined = p.Quarantined
	if st.inReady, _, err = queueState(h.amqpConn(), h.in); err != nil {
		return st, err
	}
	for _, q := range []string{h.out, h.outB} {
		n, _, err := queueState(h.amqpConn(), q)
		if err != nil {
			return st, err
		}
		st.outReady += n
	}
	return st, nil
}

// settled: every key done, downstream too, the outbox holds nothing but the
// quarantined poison rows (two per poison key), the queues are empty.
func (s state) settled(n, poisonRows int) bool {
	return s.consumer["done"] == int64(n) && len(s.consumer) == 1 && s.downDone >= int64(n) &&
		s.outbox == 0 && s.quarantined == int64(poisonRows) && s.inReady == 0 && s.outReady == 0
}

// poisonKeys is the number of keys whose handler writes poison outputs.
func (h *harness) poisonKeys() int {
	n := 0
	for _, f := range h.plan {
		if f == "poison" {
			n++
		}
	}
	return n
}

// awaitSettled polls until the system settled, or s.Settle passed.
func (h *harness) awaitSettled(ctx context.Context) bool {
	deadline := time.Now().Add(h.s.Settle)
	tick := time.NewTicker(250 * time.Millisecond)
	defer tick.Stop()
	var last state
	for {
		h.reviveCrashed()
		st, err := h.state(ctx)
		if err == nil {
			last = st
			if h.v.DB == dbRedis && st.settledRedis(h.s.Messages) {
				return true
			}
			if h.v.DB != dbRedis && st.settled(h.s.Messages, 2*h.poisonKeys()) {
				return true
			}
			if h.v.DB != dbRedis && st.quarantined < int64(2*h.poisonKeys()) {
				h.trickle(ctx)
			}
		}
		if time.Now().After(deadline) {
			h.t.Logf("not settled after %s: %s (last error: %v)", h.s.Settle, last, err)
			h.logSessions(ctx)
			return false
		}
		select {
		case <-ctx.Done():
			return false
		case <-tick.C:
		}
	}
}

// trickle writes one healthy event to the outbox, for the ticks queue: a
// live system's traffic goes on after the test's input ends.
func (h *harness) trickle(ctx context.Context) {
	tx, err := h.tables.Conn.BeginTx(ctx, nil)
	if err != nil {
		return
	}
	defer func() { _ = tx.Rollback() }()
	pub, err := h.outbox.Publisher(tx)
	if err != nil {
		return
	}
	if pub.Publish(h.ticks, message.NewMessage(watermill.NewUUID(), []byte(`{"tick":true}`))) == nil && tx.Commit() == nil {
		h.ticksSent++
	}
}

// logSessions logs the database sessions of the test's database that hold
// locks on the outbox or inbox, for a run that did not settle.
func (h *harness) logSessions(ctx context.Context) {
	if h.v.mysql() {
		h.logSessionsMySQL(ctx)
		return
	}
	rows, err := h.pool.Query(ctx, `SELECT a.pid, coalesce(a.application_name, ''), coalesce(a.state, ''),
coalesce(now() - a.xact_start, '0'::interval)::text, coalesce(left(a.query, 120), ''), count(l.*)
FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid
WHERE l.relation IN ($1::regclass, $2::regclass) AND a.pid <> pg_backend_pid()
GROUP BY 1, 2, 3, 4, 5`, h.tables.Outbox(), h.tables.Inbox())
	if err != nil {
		h.t.Logf("sessions: %v", err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var pid, locks int64
		var app, state, age, query string
		if err := rows.Scan(&pid, &app, &state, &age, &query, &locks); err == nil {
			h.t.Logf("session pid %d app %q state %q in transaction for %s, %d locks; query %q", pid, app, state, age, locks, query)
		}
	}
	var locked int64
	if err := h.pool.QueryRow(ctx, `SELECT count(*) FROM `+h.tables.Outbox()+` WHERE id NOT IN (SELECT id FROM `+h.tables.Outbox()+
		` FOR UPDATE SKIP LOCKED)`).Scan(&locked); err == nil {
		h.t.Logf("outbox rows locked by other sessions: %d", locked)
	}
	var due, deferred, quarantined int64
	if err := h.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE quarantined_at IS NULL AND (next_attempt_at IS NULL OR next_attempt_at <= now())),
count(*) FILTER (WHERE next_attempt_at > now()), count(*) FILTER (WHERE quarantined_at IS NOT NULL) FROM `+h.tables.Outbox()).Scan(&due, &deferred, &quarantined); err == nil {
		h.t.Logf("outbox rows due %d, deferred %d, quarantined %d", due, deferred, quarantined)
	}
	frows, err := h.pool.Query(ctx, `SELECT id, topic, metadata ? $1, failures, attempts,
coalesce((next_attempt_at - now())::text, ''), coalesce(left(last_error, 80), '') FROM `+h.tables.Outbox()+` WHERE quarantined_at IS NULL ORDER BY id LIMIT 10`, poisonMetadata)
	if err != nil {
		return
	}
	defer frows.Close()
	for frows.Next() {
		var id, failures, attempts int64
		var poison bool
		var topic, next, lastErr string
		if err := frows.Scan(&id, &topic, &poison, &failures, &attempts, &next, &lastErr); err == nil {
			h.t.Logf("row %d topic %s poison %v: failures %d, permanent %d, next in %s: %s",
				id, topic, poison, failures, attempts, next, lastErr)
		}
	}
}

// amqpConn is the harness's connection to RabbitMQ; in a cluster run
// connected again, to a node that answers, when a node fault closed it.
func (h *harness) amqpConn() *amqp.Connection {
	if h.v.cluster() && h.conn.IsClosed() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		conn, err := dialCluster(ctx, h.rabbit, 1)
		require.NoError(h.t, err)
		h.conn = conn
	}
	return h.conn
}

// queueState returns the ready messages and the consumers of a queue.
func queueState(conn *amqp.Connection, queue string) (int, int, error) {
	ch, err := conn.Channel()
	if err != nil {
		return 0, 0, err
	}
	defer func() { _ = ch.Close() }()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return 0, 0, err
	}
	return q.Messages, q.Consumers, nil
}

// leftovers takes what is left in the queues once every worker stopped (a
// delivery the stopping routers had not acked is requeued). A message left
// in the input queue is harmless only as a copy of a key already done; one
// left in the output queue only when downstream already processed its UUID.
func (h *harness) leftovers(ctx context.Context) (leftIn, badIn, leftOut, badOut int) {
	t := h.t
	if h.v.DB == dbRedis {
		return h.redisLeftovers(ctx)
	}
	for _, q := range []string{h.in, h.out, h.outB} {
		testenv.Eventually(t, 30*time.Second, func() bool {
			_, consumers, err := queueState(h.amqpConn(), q)
			return err == nil && consumers == 0
		}, "queue %s keeps a consumer after the workers stopped", q)
	}
	drain := func(queue string) []amqp.Delivery {
		ch, err := h.amqpConn().Channel()
		require.NoError(t, err)
		defer func() { _ = ch.Close() }()
		var out []amqp.Delivery
		for {
			d, ok, err := ch.Get(queue, true)
			require.NoError(t, err)
			if !ok {
				return out
			}
			out = append(out, d)
		}
	}
	for _, d := range drain(h.in) {
		leftIn++
		key, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
		var done bool
		require.NoError(t, h.queryRow(ctx, h.q(`SELECT EXISTS (SELECT 1 FROM `+h.tables.Inbox()+
			` WHERE consumer = $1 AND message_key = $2 AND status = 'done')`, `SELECT EXISTS (SELECT 1 FROM `+h.tables.Inbox()+
			` WHERE consumer = ? AND message_key = ? AND status = 'done')`), consumerName, key).Scan(&done))
		if !done {
			badIn++
		}
	}
	for _, d := range append(drain(h.out), drain(h.outB)...) {
		leftOut++
		id, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
		var done bool
		require.NoError(t, h.queryRow(ctx, h.q(`SELECT EXISTS (SELECT 1 FROM `+h.table("down_effects")+
			` WHERE uuid = $1)`, `SELECT EXISTS (SELECT 1 FROM `+h.table("down_effects")+` WHERE uuid = ?)`), id).Scan(&done))
		if !done {
			badOut++
		}
	}
	return leftIn, badIn, leftOut, badOut
}

// ---------------------------------------------------------------------------
// The invariants.

type row struct {
	name, value, want string
	checked, ok       bool
}

type table struct {
	title string
	rows  []row
}

// check adds a row that must hold.
func (tb *table) check(name string, value any, want string, ok bool) {
	tb.rows = append(tb.rows, row{name: name, value: fmt.Sprint(value), want: want, checked: true, ok: ok})
}

// eq adds a row whose value must equal want.
func (tb *table) eq(name string, value, want int64) {
	tb.check(name, value, "= "+strconv.FormatInt(want, 10), value == want)
}

// atLeast adds a row whose value must be >= want.
func (tb *table) atLeast(name string, value, want int64) {
	tb.check(name, value, ">= "+strconv.FormatInt(want, 10), value >= want)
}

// info adds a row that is only reported.
func (tb *table) info(name string, value any) {
	tb.rows = append(tb.rows, row{name: name, value: fmt.Sprint(value)})
}

func (tb *table) section(name string) {
	tb.rows = append(tb.rows, row{name: "-- " + name})
}

func (tb *table) String() string {
	var b strings.Builder
	b.WriteString(tb.title + "\n")
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "invariant / figure\tvalue\texpected\tresult")
	for _, r := range tb.rows {
		res := ""
		if r.checked {
			res = "ok"
			if !r.ok {
				res = "FAIL"
			}
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\n", r.name, r.value, r.want, res)
	}
	_ = w.Flush()
	return b.String()
}

func (tb *table) failed() []string {
	var out []string
	for _, r := range tb.rows {
		if r.checked && !r.ok {
			out = append(out, fmt.Sprintf("%s: %s, expected %s", r.name, r.value, r.want))
		}
	}
	return out
}

func (h *harness) count(ctx context.Context, q string, args ...any) int64 {
	h.t.Helper()
	var n int64
	require.NoError(h.t, h.queryRow(ctx, q, args...).Scan(&n), q)
	return n
}

func (h *harness) invariants(ctx context.Context, settled bool, leftIn, badIn, leftOut, badOut, left2 int) *table {
	if h.v.DB == dbRedis {
		return h.redisInvariants(ctx, settled, leftIn, badIn)
	}
	s, n := h.s, int64(h.s.Messages)
	effects, down, inbox := h.table("effects"), h.table("down_effects"), h.tables.Inbox()
	keys := h.keysArg()
	// The statements of both dialects: MariaDB quotes the column key
	// (a reserved word), takes ? for $n, JSON_TABLE for unnest, and
	// JSON_CONTAINS_PATH for jsonb's ?.
	q := h.q
	tb := &table{title: fmt.Sprintf("chaos run: %s seed=%d messages=%d dup-ratio=%.2f faults>=%d consumers=%dx%d handlers (prefetch %d), lease %s, slow %s/%s (lease/tx)",
		h.v, s.Seed, s.Messages, s.DupRatio, s.Faults, s.Consumers, s.Handlers, s.Prefetch, s.Lease, s.SlowLease, s.SlowTx)}

	tb.section("input")
	tb.eq("messages published (copies, broker-confirmed)", h.published.Load(), int64(len(h.copies)))
	tb.info("unique messages", n)
	tb.info("duplicate copies", int64(len(h.copies))-n)
	tb.check("settled (all done downstream, outbox and queues empty but for quarantined poison)", settled, "true", settled)

	tb.section("consumer (" + consumerName + ")")
	tb.eq("effects applied (rows)", h.count(ctx, `SELECT count(*) FROM `+effects), n)
	tb.eq("effects applied (distinct keys)", h.count(ctx, q(`SELECT count(DISTINCT key) FROM `+effects, "SELECT count(DISTINCT `key`) FROM "+effects)), n)
	tb.eq("messages lost (keys without an effect)", h.count(ctx, q(`SELECT count(*) FROM unnest($1::text[]) AS k(key)
WHERE NOT EXISTS (SELECT 1 FROM `+effects+` e WHERE e.key = k.key)`, `SELECT count(*) FROM `+myKeys+`
WHERE NOT EXISTS (SELECT 1 FROM `+effects+" e WHERE e.`key` = jt.k)"), keys), 0)
	tb.eq("effects of unknown keys", h.count(ctx, q(`SELECT count(*) FROM `+effects+` WHERE NOT (key = ANY($1))`,
		`SELECT count(*) FROM `+effects+" WHERE `key` NOT IN (SELECT k FROM "+myKeys+")"), keys), 0)
	tb.eq("inbox rows done", h.count(ctx, q(`SELECT count(*) FROM `+inbox+` WHERE consumer = $1 AND status = 'done'`,
		`SELECT count(*) FROM `+inbox+` WHERE consumer = ? AND status = 'done'`), consumerName), n)
	tb.eq("inbox rows left processing", h.count(ctx, q(`SELECT count(*) FROM `+inbox+` WHERE consumer = $1 AND status = 'processing'`,
		`SELECT count(*) FROM `+inbox+` WHERE consumer = ? AND status = 'processing'`), consumerName), 0)
	tb.eq("inbox rows failed or parked", h.count(ctx, q(`SELECT count(*) FROM `+inbox+` WHERE consumer = $1 AND status IN ('failed', 'parked')`,
		`SELECT count(*) FROM `+inbox+` WHERE consumer = ? AND status IN ('failed', 'parked')`), consumerName), 0)
	if h.lease() {
		tb.eq("effects whose attempt is not the inbox's done attempt (fencing)", h.count(ctx, q(`SELECT count(*) FROM `+effects+` e
JOIN `+inbox+` i ON i.consumer = $1 AND i.message_key = e.key WHERE i.status <> 'done' OR i.attempts <> e.attempt`, `SELECT count(*) FROM `+effects+` e
JOIN `+inbox+" i ON i.consumer = ? AND i.message_key = e.`key` WHERE i.status <> 'done' OR i.attempts <> e.attempt"), consumerName), 0)
	}
	h.sink.mu.Lock()
	var handled int64
	for _, c := range h.sink.events["consumer"] {
		handled += int64(c)
	}
	h.sink.mu.Unlock()
	tb.info("redeliveries (deliveries the middleware reported beyond the copies published)", handled-h.published.Load()-h.republished.Load())
	tb.info("duplicates recorded by the inbox", h.count(ctx, q(`SELECT coalesce(sum(duplicates), 0) FROM `+inbox+` WHERE consumer = $1`,
		`SELECT coalesce(sum(duplicates), 0) FROM `+inbox+` WHERE consumer = ?`), consumerName))
	if h.mode == "batch" {
		perTx := `SELECT count(*) AS n FROM ` + effects + ` GROUP BY txid`
		tb.info("group commit: transactions that committed effects", h.count(ctx, `SELECT count(*) FROM (`+perTx+`) x`))
		tb.check("group commit: effects of the largest transaction", h.count(ctx, `SELECT coalesce(max(n), 0) FROM (`+perTx+`) x`),
			"> 1", h.count(ctx, `SELECT coalesce(max(n), 0) FROM (`+perTx+`) x`) > 1)
	}
	h.events(tb, "consumer")

	if h.lease() {
		h.leaseInvariants(ctx, tb)
	}

	tb.section("outbox, relay, downstream (" + downstreamName + ")")
	p, err := testenv.OutboxStore(h.t, h.tables).Pending(ctx)
	require.NoError(h.t, err)
	poison := int64(2 * h.poisonKeys())
	ob := h.tables.Outbox()
	hasPoison := q(`metadata ? $1`, `JSON_CONTAINS_PATH(metadata, 'one', CONCAT('$.', ?))`)
	tb.eq("outbox rows pending (not quarantined)", p.Count-p.Quarantined, 0)
	tb.info("poison keys (one output refused by the broker, fanned out to two topics)", h.poisonKeys())
	tb.info("healthy events written during the settle (live traffic)", h.ticksSent)
	tb.eq("poison rows quarantined", h.count(ctx, `SELECT count(*) FROM `+ob+` WHERE quarantined_at IS NOT NULL AND `+hasPoison, poisonMetadata), poison)
	tb.eq("poison rows quarantined, by topic: "+h.out+" / "+h.out2+" (each)", h.count(ctx, `SELECT count(*) FROM `+ob+
		` WHERE quarantined_at IS NOT NULL AND `+hasPoison+q(` AND topic = $2`, ` AND topic = ?`), poisonMetadata, h.out2), poison/2)
	tb.eq("quarantined rows reported by PendingStats", p.Quarantined, poison)
	tb.eq("healthy rows quarantined", h.count(ctx, `SELECT count(*) FROM `+ob+` WHERE quarantined_at IS NOT NULL AND NOT `+hasPoison, poisonMetadata), 0)
	var lastErr string
	_ = h.queryRow(ctx, `SELECT coalesce(max(last_error), '') FROM `+ob+` WHERE quarantined_at IS NOT NULL`).Scan(&lastErr)
	tb.info("  a quarantined row's last error", truncate(lastErr, 80))
	h.sink.mu.Lock()
	relayed := h.sink.relayed
	h.sink.mu.Unlock()
	tb.atLeast("output events relayed (broker-confirmed publishes)", relayed, n)
	h.events(tb, "downstream")
	tb.eq("downstream effects (rows)", h.count(ctx, `SELECT count(*) FROM `+down), n)
	tb.eq("downstream effects (distinct keys)", h.count(ctx, q(`SELECT count(DISTINCT key) FROM `+down, "SELECT count(DISTINCT `key`) FROM "+down)), n)
	tb.eq("downstream effects (distinct output UUIDs)", h.count(ctx, `SELECT count(DISTINCT uuid) FROM `+down), n)
	tb.eq("downstream UUIDs <> committed outputs (symmetric difference)", h.count(ctx, `SELECT count(*) FROM (
(SELECT out_uuid FROM `+effects+` EXCEPT SELECT uuid FROM `+down+`) UNION ALL
(SELECT uuid FROM `+down+` EXCEPT SELECT out_uuid FROM `+effects+`)) x`), 0)
	tb.eq("messages lost downstream (keys without a downstream effect)", h.count(ctx, q(`SELECT count(*) FROM unnest($1::text[]) AS k(key)
WHERE NOT EXISTS (SELECT 1 FROM `+down+` d WHERE d.key = k.key)`, `SELECT count(*) FROM `+myKeys+`
WHERE NOT EXISTS (SELECT 1 FROM `+down+" d WHERE d.`key` = jt.k)"), keys), 0)
	tb.eq("downstream inbox rows done", h.count(ctx, q(`SELECT count(*) FROM `+inbox+` WHERE consumer = $1 AND status = 'done'`,
		`SELECT count(*) FROM `+inbox+` WHERE consumer = ? AND status = 'done'`), downstreamName), n)
	tb.info("input queue: copies left after the stop (requeued in-flight duplicates)", leftIn)
	tb.eq("input queue: messages left that were not done", int64(badIn), 0)
	tb.info("output queue: messages left after the stop", leftOut)
	tb.eq("output queue: messages left not processed downstream", int64(badOut), 0)
	tb.eq("second output queue: messages (only poison is sent there)", int64(left2), 0)

	h.faultRows(tb)
	return tb
}

// faultRows adds the faults injected and the health of the workers.
func (h *harness) faultRows(tb *table) {
	s := h.s
	tb.section("faults injected (each >= " + strconv.Itoa(s.Faults) + ")")
	f := int64(s.Faults)
	for _, k := range h.kinds() {
		if !clusterKind(k) {
			tb.atLeast(k, int64(h.injected[k]), f)
		}
	}
	if h.cc != nil {
		counts := h.cc.counted()
		for _, k := range clusterKinds {
			tb.atLeast(k, int64(counts[k]), int64(s.ClusterFaults))
			if k == faultNodeRound {
				tb.info(faultNodeKill, counts[faultNodeKill])
			}
		}
		per, all := h.cc.coverage()
		tb.check("every node SIGKILLed ("+per+")", all, "true", all)
		tb.info("input copies published again after a node fault (more duplicates)", h.republished.Load())
	}
	h.sink.mu.Lock()
	panics, slows := int64(h.sink.faults["panic"]), int64(h.sink.faults["slow"])
	h.sink.mu.Unlock()
	tb.atLeast("handler panics", panics, f)
	slowName := fmt.Sprintf("slow handlers (%s, in the transaction)", s.SlowTx)
	if h.lease() {
		slowName = fmt.Sprintf("slow handlers (%s, outliving the %s lease)", s.SlowLease, s.Lease)
	}
	tb.atLeast(slowName, slows, f)
	if h.v.DB == dbRedis {
		tb.info("AMQP / Redis connections cut", fmt.Sprintf("%d / %d", h.amqpCut, h.redisCut))
	} else {
		name := "backends terminated / AMQP connections cut"
		if h.v.mysql() {
			name = "connections KILLed / AMQP connections cut"
		}
		tb.info(name, fmt.Sprintf("%d / %d", h.terminated, h.amqpCut))
	}
	h.exitMu.Lock()
	exits := slices.Clone(h.exits)
	h.exitMu.Unlock()
	if h.bouncer != nil {
		crashes := h.bouncer.Crashes()
		tb.info("PgBouncer crashes survived (restarted; not injected)", len(crashes))
		for _, c := range crashes {
			lines := strings.Split(strings.TrimSpace(c), "\n")
			tb.info("  crash", truncate(lines[len(lines)-1], 100))
		}
	}
	tb.eq("worker exits not injected", int64(len(exits)), 0)
	for _, e := range exits {
		tb.info("  exit", e)
	}
	tb.eq("graceful stops that timed out", int64(len(h.gracefulStopFailed)), 0)
	h.sink.mu.Lock()
	tb.eq("malformed reports to the event sink", int64(len(h.sink.bad)), 0)
	h.sink.mu.Unlock()
}

// events adds the middleware events a role reported, one row per kind, and
// checks that none lacks a kind: the middleware sets one on every path it
// returns from, so an event without one means a panic escaped the middleware
// (Watermill's router recovers it and nacks).
func (h *harness) events(tb *table, role string) {
	h.sink.mu.Lock()
	defer h.sink.mu.Unlock()
	kinds := make([]string, 0, len(h.sink.events[role]))
	for k := range h.sink.events[role] {
		if k != "unknown" {
			kinds = append(kinds, k)
		}
	}
	slices.Sort(kinds)
	tb.info("middleware events reported (by kind)", "")
	for _, k := range kinds {
		tb.info("  "+k, h.sink.events[role][k])
	}
	tb.eq("panics escaping the middleware (events without a kind)", int64(h.sink.events[role]["unknown"]), 0)
}

// leaseInvariants checks the provider's calls: every key called with its one
// idempotency key, and a key called more than once only when an earlier
// attempt of it did not complete (interrupted: its lease expired mid-attempt;
// or failed after the call).
func (h *harness) leaseInvariants(ctx context.Context, tb *table) {
	n := int64(h.s.Messages)
	tb.section("lease mode: provider (idempotency key = " + consumerName + ":<key>)")
	calls := h.provider.AllCalls()
	var total int64
	for _, c := range calls {
		total += int64(c)
	}
	missing := int64(0)
	for _, k := range h.keys {
		if calls[consumerName+":"+k] == 0 {
			missing++
		}
	}
	tb.eq("distinct idempotency keys called", int64(len(calls)), n)
	tb.eq("keys never called", missing, 0)
	tb.info("calls (total)", total)

	doneAttempt := h.doneAttempts(ctx)

	h.sink.mu.Lock()
	defer h.sink.mu.Unlock()
	interrupted := 0
	for _, runs := range h.sink.runs {
		for _, r := range runs {
			if r.Interrupted {
				interrupted++
			}
		}
	}
	tb.info("handler runs after an interrupted attempt", interrupted)
	var repeated, byInterrupt, byFailure, bySlow, unexplained, beyond, unannounced, sameAttempt, slowLost int64
	for _, k := range h.keys {
		c := calls[consumerName+":"+k]
		recs := h.sink.calls[k]
		if c > len(recs) {
			unannounced++
		}
		seen := map[int]bool{}
		maxAttempt := 0
		interrupted := false
		for _, r := range recs {
			if seen[r.Attempt] {
				sameAttempt++
			}
			seen[r.Attempt] = true
			maxAttempt = max(maxAttempt, r.Attempt)
			interrupted = interrupted || r.Interrupted
		}
		if c > doneAttempt[k] || maxAttempt > doneAttempt[k] {
			beyond++
		}
		if c <= 1 {
			continue
		}
		repeated++
		failedBefore := false
		for _, a := range h.sink.failed[k] {
			failedBefore = failedBefore || a < maxAttempt
		}
		switch {
		case interrupted:
			byInterrupt++
		case failedBefore:
			byFailure++
		case h.plan[k] == "slow":
			bySlow++
		default:
			unexplained++
		}
	}
	slowLost = int64(h.sink.events["handler"]["slow_lease_lost"])
	tb.info("keys called more than once", repeated)
	tb.info("  after an interrupted attempt (lease expired mid-attempt)", byInterrupt)
	tb.info("  after an attempt that failed after its call", byFailure)
	tb.info("  on a slow key", bySlow)
	tb.eq("  unexplained repeats", unexplained, 0)
	tb.eq("keys with more calls than attempts (a call per attempt at most)", beyond, 0)
	tb.eq("two calls recorded for one attempt of a key", sameAttempt, 0)
	tb.eq("provider calls not announced by a handler run", unannounced, 0)
	tb.info("slow attempts taken over (ExtendLease: lease lost)", slowLost)
}

// poisonMetadata is the metadata key of the worker's poison outputs (the
// worker's PoisonMetadata).
const poisonMetadata = "chaos_poison"

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

func roleOf(t *testing.T, dbURL string) string {
	t.Helper()
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	return u.User.Username()
}

// doneAttempts returns the attempt each done key completed with.
func (h *harness) doneAttempts(ctx context.Context) map[string]int {
	done := map[string]int{}
	if h.v.DB == dbRedis {
		for k, rec := range h.redisRecords(ctx) {
			if rec["status"] == "done" {
				done[k], _ = strconv.Atoi(rec["attempts"])
			}
		}
		return done
	}
	require.NoError(h.t, h.each(ctx, h.q(`SELECT message_key, attempts FROM `+h.tables.Inbox()+` WHERE consumer = $1 AND status = 'done'`,
		`SELECT message_key, attempts FROM `+h.tables.Inbox()+` WHERE consumer = ? AND status = 'done'`), []any{consumerName},
		func(scan func(...any) error) error {
			var k string
			var a int
			if err := scan(&k, &a); err != nil {
				return err
			}
			done[k] = a
			return nil
		}))
	return done
}
