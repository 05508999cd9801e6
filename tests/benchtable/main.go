// Command benchtable prints the benchmark table of docs/benchmarks.md: every
// line compares variants measured side by side in one run, in alternating
// rounds, and reports each variant's median rate (with min–max over the
// rounds) and the ratio of the medians.
//
//	go run ./tests/benchtable            # the full table (make bench)
//	BENCH_QUICK=1 go run ./tests/benchtable   # tiny sizes, a minute or two
//	go run ./tests/benchtable -h         # every flag; each has a BENCH_* variable
//
// Sections (-only router,relay,ordered,rss,wake,retention,broker). The router,
// relay and retention sections have an engine dimension (-engines
// postgres,mariadb, both by default; engine.go): their engine-neutral
// variants run on each engine in the same alternating rounds, and a line
// carries its engine (" · postgres", " · mariadb"), or compares the engines
// (A mariadb, B postgres). ordered, rss and wake are PostgreSQL's only.
//
//   - router: a Watermill router drains a pre-filled durable RabbitMQ queue;
//     the handler does one INSERT into a business table. Modes: no
//     middleware (its own BEGIN/INSERT/COMMIT on the pool), per-message
//     middleware (PgxTxFromContext), group commit (Config.Batch,
//     PgxTxFromContext) and group commit with exactlyonce.Exec; each over
//     rabbitmq.Subscriber (prefetch 64, or 256 for group commit) and over
//     watermill-amqp's subscriber (ConcurrentSubscriber, 64 subscriptions of
//     prefetch 64: the setup before rabbitmq.Subscriber); and a bare
//     amqp091 consumer (prefetch 256, an ack per message, no database).
//     On MariaDB the four modes over rabbitmq.Subscriber (StdTxFromContext
//     instead of PgxTxFromContext).
//   - relay: an outbox backlog of 10k, 100k and 1M rows (all three tables
//     exist at once, so that backlogs too are compared side by side) drained
//     to a RabbitMQ queue by outbox.Relay through rabbitmq.Publisher (the
//     confirm window), by outbox.Relay through watermill-amqp's publisher
//     (ConfirmDelivery), and by Watermill's forwarder component (watermill-sql's
//     default PostgreSQL schema as its storage, watermill-amqp as its
//     out-publisher), each from a backlog of its own format. On MariaDB
//     the relay through rabbitmq.Publisher, at the same backlogs.
//   - ordered: per-key order (see ordered.go): the relay alone with 1,000
//     ordering keys, with one hot key, and without keys; end to end (relay
//     and a consuming router together, per-message and group commit +
//     Exec) with 1,000 keys on 16 partition queues against no key on one
//     queue, 16 deliveries in flight each; a bare amqp091 consumer on both
//     layouts (the broker's share).
//   - wake: commit-to-consumer latency at a steady 100 events/s, relay with
//     wake-on-commit against polling every 100 ms; and the writers' cost of
//     the NOTIFY (one-row outbox transactions from 8 writers, with and
//     without it). See wake.go.
//   - retention: claim p99 on a large inbox (-retention-rows, 10M) and while
//     retention removes a day of rows, for the plain table (row purge) and
//     the daily-partitioned one (partition drop); bytes per row. On
//     MariaDB the plain table (-retention-rows-mariadb rows).
//   - rss: the peak RSS (VmHWM) of a relay process and of a consuming service
//     (a router with the middleware, group commit + Exec) at a 1k and a 1M
//     backlog, each a subprocess (this binary re-executed with -child).
//   - broker (not run unless -only names it; broker.go): the relay through
//     rabbitmq.Publisher (1 and 4 workers) and a router with the middleware
//     through rabbitmq.Subscriber (per-message, group commit + Exec) on the
//     single node with classic queues, with quorum queues, and on a local
//     three-node cluster with quorum queues (clients on the queues' leader,
//     or on followers), which the section starts and stops.
//
// -stmts adds where the time goes: each router and relay run's statements
// per message or event, and their time, on each engine (stmts.go).
//
// It is a main package, not a test: it re-executes itself as the relay and
// consumer processes whose RSS it reads, it must not run under `go test
// ./...`, and its output is a table, not benchmark lines.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// config is every knob of the harness. Each flag defaults to its BENCH_*
// environment variable, then to the full-size value, or with -quick
// (BENCH_QUICK=1) to the quick-check value.
type config struct {
	quick   bool
	only    map[string]bool
	engines []engine // the router, relay and retention sections' engines
	rounds  int
	cpu     bool
	stmts   bool // -stmts: statements per message or event
	profDir string

	// router
	messages int
	inflight int
	prefetch int
	// batchPrefetch is rabbitmq.Subscriber's prefetch in the group
	// commit variants, and the bare consumer's.
	batchPrefetch int
	pool          int

	// relay
	backlogs     []int
	relayRows    int
	relayTime    time.Duration
	relayBatch   int
	relayWorkers int
	window       int

	// ordered
	orderedRows int
	orderedE2E  int

	// rss
	rssBacklogs []int
	rssMessages int

	// wake
	wakeRate      int
	wakeTime      time.Duration
	wakeWriters   int
	wakeWriteTime time.Duration

	// retention
	retentionRows    int
	retentionRowsMy  int // MariaDB's inbox (-retention-rows-mariadb)
	retentionClaims  int
	retentionWorkers int

	// broker (broker.go)
	brokerSetups   []string
	brokerRows     int
	brokerMessages int
	brokerWorkers  []int

	dbURL    string
	mysqlURL string
	amqpURL  string

	child childConfig
}

type childConfig struct {
	kind   string // "relay" or "consumer"; empty in the parent
	schema string
	queue  string
	count  int
}

// sizes is a flag's full-size and quick-check defaults.
type sizes struct{ full, quick string }

func parseConfig(args []string) (*config, error) {
	fs := flag.NewFlagSet("benchtable", flag.ContinueOnError)
	env := func(name, def string) string {
		if v, ok := os.LookupEnv(name); ok && v != "" {
			return v
		}
		return def
	}
	quick := fs.Bool("quick", env("BENCH_QUICK", "") != "" && env("BENCH_QUICK", "") != "0", "quick check with tiny sizes (BENCH_QUICK=1)")
	s := map[string]*string{}
	def := func(name, envName string, sz sizes, usage string) {
		s[name] = fs.String(name, env(envName, ""), fmt.Sprintf("%s (%s; default %s, quick %s)", usage, envName, sz.full, sz.quick))
	}
	table := map[string]sizes{
		"only":                   {"router,relay,ordered,rss,wake,retention", "router,relay,ordered,rss,wake,retention"},
		"engines":                {"postgres,mariadb", "postgres,mariadb"},
		"ordered-rows":           {"50000", "3000"},
		"ordered-e2e":            {"20000", "2000"},
		"wake-rate":              {"100", "100"},
		"wake-time":              {"20s", "3s"},
		"wake-writers":           {"8", "8"},
		"wake-write-time":        {"5s", "2s"},
		"rounds":                 {"5", "5"},
		"messages":               {"30000", "1000"},
		"inflight":               {"64", "64"},
		"prefetch":               {"64", "64"},
		"batch-prefetch":         {"256", "256"},
		"pool":                   {"20", "20"},
		"backlogs":               {"10000,100000,1000000", "1000,5000,20000"},
		"relay-rows":             {"100000", "2000"},
		"relay-time":             {"15s", "3s"},
		"relay-batch":            {"500", "500"},
		"relay-workers":          {"4", "4"},
		"window":                 {"256", "256"},
		"rss-backlogs":           {"1000,10000,1000000", "1000,5000,20000"},
		"rss-messages":           {"50000", "3000"},
		"retention-rows":         {"10000000", "200000"},
		"retention-rows-mariadb": {"-retention-rows", "50000"},
		"retention-claims":       {"20000", "3000"},
		"retention-workers":      {"1", "1"},
		"broker-setups":          {"classic,quorum,cluster,cluster-spread", "classic,quorum,cluster,cluster-spread"},
		"broker-rows":            {"10000", "500"},
		"broker-messages":        {"10000", "500"},
		"broker-relay-workers":   {"1,4", "1,4"},
	}
	def("only", "BENCH_ONLY", table["only"], "sections to run, comma-separated: router, relay, ordered, rss, wake, retention, broker (not in the default: it starts a three-node RabbitMQ cluster)")
	def("engines", "BENCH_ENGINES", table["engines"], "databases the router, relay and retention sections run on, comma-separated: postgres, mariadb (ordered, rss and wake: PostgreSQL only)")
	def("ordered-rows", "BENCH_ORDERED_ROWS", table["ordered-rows"], "ordered: rows relayed per relay round (the hot key's also stop after -relay-time)")
	def("ordered-e2e", "BENCH_ORDERED_E2E", table["ordered-e2e"], "ordered: messages relayed and consumed per end-to-end round")
	def("wake-rate", "BENCH_WAKE_RATE", table["wake-rate"], "wake: events per second written during the latency rounds")
	def("wake-time", "BENCH_WAKE_TIME", table["wake-time"], "wake: length of a latency round per variant")
	def("wake-writers", "BENCH_WAKE_WRITERS", table["wake-writers"], "wake: concurrent writers of the NOTIFY cost lines")
	def("wake-write-time", "BENCH_WAKE_WRITE_TIME", table["wake-write-time"], "wake: length of a NOTIFY cost round per variant")
	def("rounds", "BENCH_ROUNDS", table["rounds"], "alternating rounds per line (at least 5 for the table)")
	def("messages", "BENCH_MESSAGES", table["messages"], "router: messages drained per variant per round")
	def("inflight", "BENCH_INFLIGHT", table["inflight"], "router: deliveries in flight (ConcurrentSubscriber n)")
	def("prefetch", "BENCH_PREFETCH", table["prefetch"], "router: AMQP prefetch of each subscription (rabbitmq.Subscriber's for no middleware and per-message)")
	def("batch-prefetch", "BENCH_BATCH_PREFETCH", table["batch-prefetch"], "router: rabbitmq.Subscriber's prefetch for the group commit variants, and the bare consumer's")
	def("pool", "BENCH_POOL", table["pool"], "router: pgxpool MaxConns (the same for every variant)")
	def("backlogs", "BENCH_BACKLOGS", table["backlogs"], "relay: pending rows, comma-separated")
	def("relay-rows", "BENCH_RELAY_ROWS", table["relay-rows"], "relay: rows timed per round (at most the backlog, which is topped up between rounds)")
	def("relay-time", "BENCH_RELAY_TIME", table["relay-time"], "relay: a round also stops after this long (slow variants)")
	def("relay-batch", "BENCH_RELAY_BATCH", table["relay-batch"], "relay: RelayConfig.BatchSize of both relay variants")
	def("relay-workers", "BENCH_RELAY_WORKERS", table["relay-workers"], "relay: RelayConfig.Workers of both relay variants")
	def("window", "BENCH_WINDOW", table["window"], "relay: rabbitmq.PublisherConfig.Window")
	def("rss-backlogs", "BENCH_RSS_BACKLOGS", table["rss-backlogs"], "rss: backlogs, comma-separated, ascending: the last is compared with each other")
	def("rss-messages", "BENCH_RSS_MESSAGES", table["rss-messages"], "rss: messages each relay / consumer process handles")
	def("retention-rows", "BENCH_RETENTION_ROWS", table["retention-rows"], "retention: rows in each layout's inbox (spread over 7 days + one per round)")
	def("retention-rows-mariadb", "BENCH_RETENTION_ROWS_MARIADB", table["retention-rows-mariadb"], "retention: rows in MariaDB's inbox (filled from a SEQUENCE table)")
	def("retention-claims", "BENCH_RETENTION_CLAIMS", table["retention-claims"], "retention: claims timed per measurement")
	def("retention-workers", "BENCH_RETENTION_WORKERS", table["retention-workers"], "retention: concurrent claimers (1: the claim's own latency; more: with CPU contention on small machines)")
	def("broker-setups", "BENCH_BROKER_SETUPS", table["broker-setups"], "broker: setups compared with classic (the single node's classic queues), comma-separated: classic, quorum, cluster, cluster-spread")
	def("broker-rows", "BENCH_BROKER_ROWS", table["broker-rows"], "broker: outbox rows relayed per setup per round")
	def("broker-messages", "BENCH_BROKER_MESSAGES", table["broker-messages"], "broker: messages consumed per setup per round and mode")
	def("broker-relay-workers", "BENCH_BROKER_RELAY_WORKERS", table["broker-relay-workers"], "broker: RelayConfig.Workers of the relay lines, comma-separated (a line each)")
	cpu := fs.Bool("cpu", env("BENCH_CPU", "") != "" && env("BENCH_CPU", "") != "0", "also print where the CPU went during the timed sections (BENCH_CPU=1)")
	stmts := fs.Bool("stmts", env("BENCH_STMTS", "") != "" && env("BENCH_STMTS", "") != "0", "also print the statements per message or event of the router and relay runs, and their time, on each engine (BENCH_STMTS=1)")
	prof := fs.String("cpuprofile", env("BENCH_CPUPROFILE", ""), "directory: write a CPU profile of this process per variant (first round) (BENCH_CPUPROFILE)")
	child := fs.String("child", "", "internal: run as the relay or consumer process of the rss section")
	childSchema := fs.String("child-schema", "", "internal")
	childQueue := fs.String("child-queue", "", "internal")
	childCount := fs.Int("child-count", 0, "internal")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	get := func(name string) string {
		if v := *s[name]; v != "" {
			return v
		}
		if *quick {
			return table[name].quick
		}
		return table[name].full
	}
	var err error
	num := func(name string) int {
		v, e := strconv.Atoi(strings.ReplaceAll(get(name), "_", ""))
		if e != nil || v <= 0 {
			err = fmt.Errorf("-%s: want a positive integer, got %q", name, get(name))
		}
		return v
	}
	list := func(name string) []int {
		var out []int
		for _, f := range strings.Split(get(name), ",") {
			v, e := strconv.Atoi(strings.ReplaceAll(strings.TrimSpace(f), "_", ""))
			if e != nil || v <= 0 {
				err = fmt.Errorf("-%s: want positive integers, got %q", name, get(name))
			}
			out = append(out, v)
		}
		return out
	}
	c := &config{
		quick:            *quick,
		only:             map[string]bool{},
		rounds:           num("rounds"),
		cpu:              *cpu,
		stmts:            *stmts,
		profDir:          *prof,
		messages:         num("messages"),
		inflight:         num("inflight"),
		prefetch:         num("prefetch"),
		batchPrefetch:    num("batch-prefetch"),
		pool:             num("pool"),
		backlogs:         list("backlogs"),
		relayRows:        num("relay-rows"),
		orderedRows:      num("ordered-rows"),
		orderedE2E:       num("ordered-e2e"),
		relayBatch:       num("relay-batch"),
		relayWorkers:     num("relay-workers"),
		window:           num("window"),
		rssBacklogs:      list("rss-backlogs"),
		rssMessages:      num("rss-messages"),
		wakeRate:         num("wake-rate"),
		wakeWriters:      num("wake-writers"),
		retentionRows:    num("retention-rows"),
		retentionClaims:  num("retention-claims"),
		retentionWorkers: num("retention-workers"),
		brokerRows:       num("broker-rows"),
		brokerMessages:   num("broker-messages"),
		brokerWorkers:    list("broker-relay-workers"),
		dbURL:            env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"),
		mysqlURL:         env("MYSQL_URL", "mysql://root@127.0.0.1:3306/test"),
		amqpURL:          env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
		child:            childConfig{kind: *child, schema: *childSchema, queue: *childQueue, count: *childCount},
	}
	c.retentionRowsMy = c.retentionRows
	if get("retention-rows-mariadb") != "-retention-rows" {
		c.retentionRowsMy = num("retention-rows-mariadb")
	}
	if err != nil {
		return nil, err
	}
	if c.brokerSetups, err = parseBrokerSetups(get("broker-setups")); err != nil {
		return nil, err
	}
	if c.engines, err = parseEngines(get("engines")); err != nil {
		return nil, err
	}
	if c.relayTime, err = time.ParseDuration(get("relay-time")); err != nil {
		return nil, fmt.Errorf("-relay-time: %w", err)
	}
	if c.wakeTime, err = time.ParseDuration(get("wake-time")); err != nil {
		return nil, fmt.Errorf("-wake-time: %w", err)
	}
	if c.wakeWriteTime, err = time.ParseDuration(get("wake-write-time")); err != nil {
		return nil, fmt.Errorf("-wake-write-time: %w", err)
	}
	for _, sec := range strings.Split(get("only"), ",") {
		sec = strings.TrimSpace(sec)
		switch sec {
		case "router", "relay", "ordered", "rss", "wake", "retention", "broker":
			c.only[sec] = true
		case "":
		default:
			return nil, fmt.Errorf("-only: unknown section %q (router, relay, ordered, rss, wake, retention, broker)", sec)
		}
	}
	if len(c.rssBacklogs) < 2 || !slices.IsSorted(c.rssBacklogs) {
		return nil, fmt.Errorf("-rss-backlogs: want at least two backlogs in ascending order, got %v", c.rssBacklogs)
	}
	return c, nil
}

func main() { os.Exit(mainCode()) }

func mainCode() int {
	cfg, err := parseConfig(os.Args[1:])
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "benchtable:", err)
		return 2
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if cfg.child.kind != "" {
		if err := runChild(ctx, cfg); err != nil {
			fmt.Fprintln(os.Stderr, "benchtable child:", err)
			return 1
		}
		return 0
	}
	if err := run(ctx, cfg); err != nil {
		fmt.Fprintln(os.Stderr, "benchtable:", err)
		return 1
	}
	return 0
}

func run(ctx context.Context, cfg *config) error {
	h, err := newHarness(ctx, cfg)
	if err != nil {
		return err
	}
	defer h.cleanup()

	start := time.Now()
	loadBefore := loadavg()
	logf("benchtable: load average before: %s; %d rounds; sections %s; engines %s", loadBefore, cfg.rounds, sectionList(cfg), engineList(cfg))
	var lines []*line
	if cfg.only["router"] {
		l, err := h.routerSection(ctx)
		if err != nil {
			return fmt.Errorf("router section: %w", err)
		}
		lines = append(lines, l...)
	}
	if cfg.only["relay"] {
		l, err := h.relaySection(ctx)
		if err != nil {
			return fmt.Errorf("relay section: %w", err)
		}
		lines = append(lines, l...)
	}
	if cfg.only["ordered"] {
		l, err := h.orderedSection(ctx)
		if err != nil {
			return fmt.Errorf("ordered section: %w", err)
		}
		lines = append(lines, l...)
	}
	if cfg.only["rss"] {
		l, err := h.rssSection(ctx)
		if err != nil {
			return fmt.Errorf("rss section: %w", err)
		}
		lines = append(lines, l...)
	}
	if cfg.only["wake"] {
		l, err := h.wakeSection(ctx)
		if err != nil {
			return fmt.Errorf("wake section: %w", err)
		}
		lines = append(lines, l...)
	}
	if cfg.only["retention"] {
		l, err := h.retentionSection(ctx)
		if err != nil {
			return fmt.Errorf("retention section: %w", err)
		}
		lines = append(lines, l...)
	}
	if cfg.only["broker"] {
		l, err := h.brokerSection(ctx)
		if err != nil {
			return fmt.Errorf("broker section: %w", err)
		}
		lines = append(lines, l...)
	}
	loadAfter := loadavg()

	host, _ := os.Hostname()
	fmt.Printf("benchtable %s: %s, %s/%s, %d CPUs, host %s; %d alternating rounds per line; %s in all\n",
		start.Format("2006-01-02 15:04"), runtime.Version(), runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), host, cfg.rounds, time.Since(start).Round(time.Second))
	fmt.Printf("load average (1, 5, 15 min) before: %s, after: %s\n", loadBefore, loadAfter)
	fmt.Printf("engines (router, relay, retention): %s\n", engineList(cfg))
	retentionRows := strconv.Itoa(cfg.retentionRows)
	if cfg.hasEngine(mariadb) && cfg.retentionRowsMy != cfg.retentionRows {
		retentionRows += fmt.Sprintf(" (MariaDB's: %d)", cfg.retentionRowsMy)
	}
	fmt.Printf("router: %d msgs per variant per round, %d in flight, prefetch %d (group commit on rabbitmq.Subscriber and the bare consumer: %d), pool %d; relay: BatchSize %d, Workers %d, window %d, up to %d rows or %s per round; rss: %d msgs per process; retention: %s rows per layout, %d claims per measurement\n\n",
		cfg.messages, cfg.inflight, cfg.prefetch, cfg.batchPrefetch, cfg.pool, cfg.relayBatch, cfg.relayWorkers, cfg.window, cfg.relayRows, cfg.relayTime, cfg.rssMessages,
		retentionRows, cfg.retentionClaims)
	if cfg.only["broker"] {
		fmt.Println(brokerSummary(cfg))
		fmt.Println()
	}
	printTable(os.Stdout, lines)
	if cfg.cpu {
		fmt.Println()
		h.printCPU(os.Stdout)
	}
	if cfg.stmts {
		fmt.Println()
		h.printStmts(os.Stdout)
	}
	return nil
}

func sectionList(cfg *config) string {
	var s []string
	for _, k := range []string{"router", "relay", "ordered", "rss", "wake", "retention", "broker"} {
		if cfg.only[k] {
			s = append(s, k)
		}
	}
	return strings.Join(s, ",")
}

func engineList(cfg *config) string {
	var s []string
	for _, e := range cfg.engines {
		s = append(s, string(e))
	}
	return strings.Join(s, ",")
}

// logf reports progress on stderr; the table goes to stdout.
func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, time.Now().Format("15:04:05 ")+format+"\n", args...)
}

// loadavg is the first three fields of /proc/loadavg.
func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}
