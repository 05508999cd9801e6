package chaos

// The harness: settings, the worker processes, the event sink the workers
// report to, the publisher of the input messages and the fault scheduler.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

// Names shared with ./worker (its constants of the same names).
const (
	consumerName   = "chaos-consumer"
	downstreamName = "chaos-downstream"
)

// settings of a chaos run, from the environment (see TestChaos).
type settings struct {
	Messages int     // unique messages (CHAOS_MESSAGES)
	DupRatio float64 // extra copies per unique message (CHAOS_DUP_RATIO)
	Faults   int     // at least this many faults of each kind (CHAOS_FAULTS)
	// ClusterFaults: at least this many of each cluster fault in a
	// cluster run (CHAOS_CLUSTER_FAULTS, default 1): rounds of node kills,
	// majorities lost. Each is ~10-25 s of node restarts.
	ClusterFaults    int
	clusterFaultsSet bool // CHAOS_CLUSTER_FAULTS was given: full rounds (else compact, see clusterChaos)
	// messagesSet, faultsSet: CHAOS_MESSAGES, CHAOS_FAULTS were given
	// (otherwise a MariaDB run is smaller: forRun).
	messagesSet, faultsSet bool
	Runs                   []variant
	Seed                   uint64
	Settle                 time.Duration // bound of the wait for the system to settle

	Consumers int // consumer processes
	Handlers  int // router handlers per consumer process
	Prefetch  int
	PanicRate float64 // share of keys whose handler panics once
	SlowRate  float64 // share of keys whose handler is slow once
	Lease     time.Duration
	SlowLease time.Duration // a slow handler in lease mode: longer than Lease
	SlowTx    time.Duration // a slow handler in transactional mode
	// RelayMaxAttempts is the relay's MaxAttempts: small, so that a
	// failure of a healthy row counted as permanent would quarantine it
	// within the run.
	RelayMaxAttempts int
}

// variant is one run of the suite: a mode, and how the workers reach the
// database (PostgreSQL, or MariaDB for @mariadb and @mariadb-rc).
type variant struct {
	Mode string // transactional | lease | batch (transactional with group commit)
	// DB is direct (through the harness's TCP proxy), repeatable-read (the
	// same, as a role whose default transaction isolation is REPEATABLE
	// READ) or pgbouncer (through a PgBouncer in transaction pooling, whose
	// server connections go through the proxy), or redis (lease mode only:
	// the consumers keep lease records in Redis, through a proxy of the
	// harness, and use no database; no relay, no downstream), or mariadb
	// (MariaDB through the proxy, under its default REPEATABLE READ) or
	// mariadb-rc (the same, the workers' sessions defaulting to READ
	// COMMITTED: tx_isolation in their DSN). The MariaDB runs use the MySQL
	// dialect end to end: a fresh database per run, the workers on
	// go-sql-driver/mysql (CHAOS_DRIVER=mysql), and the "kill the backend"
	// fault is KILL of their connections.
	DB string
	// Subscriber is how the consumers take deliveries: "" (watermill-amqp's
	// subscriber, several subscriptions) or "rabbitmq" (written mode+rabbitmq:
	// rabbitmq.Subscriber, one subscription with a prefetch window and
	// batched acks), or "cluster" (mode+cluster: rabbitmq.Subscriber on the
	// three-node cluster, see cluster_test.go).
	Subscriber string
}

// subCluster is the subscriber of the cluster runs: every worker on the
// package's own publisher and subscriber, knowing the cluster's three
// nodes, every queue a quorum queue, and the nodes SIGKILLed.
const subCluster = "cluster"

// cluster reports whether the run is on the three-node cluster.
func (v variant) cluster() bool { return v.Subscriber == subCluster }

func (v variant) String() string {
	s := v.Mode
	if v.Subscriber != "" {
		s += "+" + v.Subscriber
	}
	if v.DB == dbDirect {
		return s
	}
	return s + "@" + v.DB
}

const (
	dbDirect         = "direct"
	dbRepeatableRead = "repeatable-read"
	dbPgBouncer      = "pgbouncer"
	dbRedis          = "redis"
	dbMariaDB        = "mariadb"
	dbMariaDBRC      = "mariadb-rc"
)

// mysql reports whether the run's database is MariaDB (the MySQL dialect).
func (v variant) mysql() bool { return v.DB == dbMariaDB || v.DB == dbMariaDBRC }

// defaultRuns is the short form's set: both modes directly, group commit
// directly, and one of each other database setup; rabbitmq.Subscriber
// with group commit under REPEATABLE READ and per message through
// PgBouncer; on MariaDB per message (REPEATABLE READ), group commit
// under READ COMMITTED and lease mode. The cluster runs (batch+cluster,
// transactional+cluster) are in `make chaos`; the short form has the
// ordered transactional+cluster run (TestChaosOrdered), which keeps
// `make test` within its time.
const defaultRuns = "transactional,lease,batch,lease@repeatable-read,transactional@pgbouncer,lease@redis,batch+rabbitmq@repeatable-read,transactional+rabbitmq@pgbouncer," +
	"transactional@mariadb,batch@mariadb-rc,lease@mariadb"

// parseRuns reads CHAOS_MODES: a comma-separated list of mode or mode@db.
func parseRuns(v string) ([]variant, error) {
	var out []variant
	for item := range strings.SplitSeq(v, ",") {
		item = strings.TrimSpace(item)
		mode, db, _ := strings.Cut(item, "@")
		if db == "" {
			db = dbDirect
		}
		mode, sub, _ := strings.Cut(mode, "+")
		if sub != "" && ((sub != "rabbitmq" && sub != subCluster) || mode == "lease") {
			return nil, fmt.Errorf("CHAOS_MODES: %q: the subscriber after + can only be rabbitmq or cluster, in transactional or batch mode", item)
		}
		if mode != "transactional" && mode != "lease" && mode != "batch" {
			return nil, fmt.Errorf("CHAOS_MODES: %q: the mode must be transactional, lease or batch", item)
		}
		if !slices.Contains([]string{dbDirect, dbRepeatableRead, dbPgBouncer, dbRedis, dbMariaDB, dbMariaDBRC}, db) {
			return nil, fmt.Errorf("CHAOS_MODES: %q: the database setup must be %s, %s, %s, %s, %s or %s", item,
				dbDirect, dbRepeatableRead, dbPgBouncer, dbRedis, dbMariaDB, dbMariaDBRC)
		}
		if sub == subCluster && db == dbRedis {
			return nil, fmt.Errorf("CHAOS_MODES: %q: a cluster run needs the outbox (no @redis)", item)
		}
		if db == dbRedis && mode != "lease" {
			return nil, fmt.Errorf("CHAOS_MODES: %q: the Redis store is for lease mode only (lease@redis)", item)
		}
		out = append(out, variant{Mode: mode, DB: db, Subscriber: sub})
	}
	return out, nil
}

func readSettings(t *testing.T) settings {
	t.Helper()
	s := settings{
		Messages: 800, DupRatio: 0.2, Faults: 3, ClusterFaults: 1,
		Seed: uint64(time.Now().UnixNano()), Settle: 2 * time.Minute,
		Consumers: 3, Handlers: 4, Prefetch: 10, PanicRate: 0.02, SlowRate: 0.01,
		Lease: 2 * time.Second, SlowLease: 3 * time.Second, SlowTx: 1500 * time.Millisecond,
		RelayMaxAttempts: 1,
	}
	var err error
	s.Runs, err = parseRuns(defaultRuns)
	require.NoError(t, err)
	if v := os.Getenv("CHAOS_MESSAGES"); v != "" {
		s.Messages, err = strconv.Atoi(v)
		require.NoError(t, err, "CHAOS_MESSAGES")
		require.Positive(t, s.Messages, "CHAOS_MESSAGES")
		s.messagesSet = true
	}
	if v := os.Getenv("CHAOS_DUP_RATIO"); v != "" {
		s.DupRatio, err = strconv.ParseFloat(v, 64)
		require.NoError(t, err, "CHAOS_DUP_RATIO")
		require.True(t, s.DupRatio >= 0 && s.DupRatio <= 1, "CHAOS_DUP_RATIO must be within [0, 1]")
	}
	if v := os.Getenv("CHAOS_FAULTS"); v != "" {
		s.Faults, err = strconv.Atoi(v)
		require.NoError(t, err, "CHAOS_FAULTS")
		require.Positive(t, s.Faults, "CHAOS_FAULTS")
		s.faultsSet = true
	}
	if v := os.Getenv("CHAOS_CLUSTER_FAULTS"); v != "" {
		s.ClusterFaults, err = strconv.Atoi(v)
		require.NoError(t, err, "CHAOS_CLUSTER_FAULTS")
		require.Positive(t, s.ClusterFaults, "CHAOS_CLUSTER_FAULTS")
		s.clusterFaultsSet = true
	}
	require.LessOrEqual(t, 6*s.Faults, s.Messages, "CHAOS_MESSAGES must be at least 6 x CHAOS_FAULTS (panicking, slow and poison keys are spread over the messages)")
	if v := os.Getenv("CHAOS_MODES"); v != "" {
		s.Runs, err = parseRuns(v)
		require.NoError(t, err)
	}
	if v := os.Getenv("CHAOS_SEED"); v != "" {
		s.Seed, err = strconv.ParseUint(v, 10, 64)
		require.NoError(t, err, "CHAOS_SEED")
	}
	if v := os.Getenv("CHAOS_SETTLE"); v != "" {
		s.Settle, err = time.ParseDuration(v)
		require.NoError(t, err, "CHAOS_SETTLE")
	}
	return s
}

// The short form's size of a MariaDB run (CHAOS_MESSAGES and CHAOS_FAULTS
// override it): the fault schedule sets a run's length, and three MariaDB
// runs at the PostgreSQL runs' size would add a minute and a half to
// `make test`.
const (
	mariaDBMessages = 500
	mariaDBFaults   = 2
)

// The short form's size of a cluster run: its node faults (a round of
// three restarts, a majority lost for 10 s) set its length, ~45 s.
const (
	clusterMessages = 400
	clusterFaults   = 1
)

// forRun is s sized for the run v: a MariaDB or cluster run is smaller
// unless CHAOS_MESSAGES or CHAOS_FAULTS set the size.
func (s settings) forRun(v variant) settings {
	messages, faults := mariaDBMessages, mariaDBFaults
	switch {
	case v.cluster():
		messages, faults = clusterMessages, clusterFaults
	case !v.mysql():
		return s
	}
	if !s.messagesSet {
		s.Messages = messages
	}
	if !s.faultsSet {
		s.Faults = faults
	}
	return s
}

// buildWorker builds ./worker once per test run (without -race: the CPU is
// for the system under test) and returns the binary's path.
func buildWorker(t *testing.T) string {
	t.Helper()
	return buildBinary(t, "./worker", "chaos-worker")
}

// buildBinary builds the command pkg (a directory of this package's) into a
// temporary directory, without -race, and returns the binary's path.
func buildBinary(t *testing.T, pkg, name string) string {
	t.Helper()
	goBin, err := exec.LookPath("go")
	if err != nil {
		goBin = filepath.Join(os.Getenv("GOROOT"), "bin", "go")
	}
	bin := filepath.Join(t.TempDir(), name)
	start := time.Now()
	out, err := exec.Command(goBin, "build", "-o", bin, pkg).CombinedOutput()
	require.NoError(t, err, "building %s:\n%s", pkg, out)
	t.Logf("%s built in %s", pkg, time.Since(start).Round(time.Millisecond))
	return bin
}

// ---------------------------------------------------------------------------
// The event sink: the workers report to it over HTTP (it lives in the
// harness, which no fault touches).

type runRec struct {
	Attempt     int
	Interrupted bool
	Worker      string
}

type sink struct {
	srv *httptest.Server

	mu       sync.Mutex
	plan     map[string]string // key -> planned fault ("panic", "slow", "poison")
	injected map[string]bool   // key -> its planned fault was injected
	faults   map[string]int    // fault -> injected
	runs     map[string][]runRec
	calls    map[string][]runRec
	events   map[string]map[string]int // role -> event kind -> count
	failed   map[string][]int          // key -> attempts that failed (EventFailed, or failed after the provider call)
	relayed  int64
	bad      []string // malformed requests
}

func newSink(t *testing.T, plan map[string]string) *sink {
	t.Helper()
	s := &sink{
		plan: plan, injected: map[string]bool{}, faults: map[string]int{},
		runs: map[string][]runRec{}, calls: map[string][]runRec{},
		events: map[string]map[string]int{}, failed: map[string][]int{},
	}
	s.srv = httptest.NewServer(http.HandlerFunc(s.serve))
	t.Cleanup(s.srv.Close)
	return s
}

func (s *sink) serve(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	key := q.Get("key")
	attempt, _ := strconv.Atoi(q.Get("attempt"))
	rec := runRec{Attempt: attempt, Interrupted: q.Get("interrupted") == "true", Worker: q.Get("worker")}
	s.mu.Lock()
	defer s.mu.Unlock()
	switch r.URL.Path {
	case "/run":
		s.runs[key] = append(s.runs[key], rec)
		f := s.plan[key]
		if f != "" && !s.injected[key] {
			s.injected[key] = true
			s.faults[f]++
			_, _ = w.Write([]byte(f))
		} else if f == "poison" {
			// Every run of a poison key writes the poison outputs: only the
			// run whose transaction commits leaves them in the outbox.
			_, _ = w.Write([]byte(f))
		}
	case "/call":
		s.calls[key] = append(s.calls[key], rec)
	case "/event":
		role, kind := q.Get("role"), q.Get("kind")
		if s.events[role] == nil {
			s.events[role] = map[string]int{}
		}
		s.events[role][kind]++
		if (role == "consumer" && kind == "failed") || (role == "handler" && kind == "failed_after_call") {
			s.failed[key] = append(s.failed[key], attempt)
		}
	case "/relayed":
		n, err := strconv.Atoi(q.Get("n"))
		if err != nil {
			s.bad = append(s.bad, r.URL.String())
		}
		s.relayed += int64(n)
	default:
		s.bad = append(s.bad, r.URL.String())
		http.Error(w, "unknown path", http.StatusNotFound)
	}
}

// ---------------------------------------------------------------------------
// Worker processes.

type proc struct {
	h    *harness
	name string
	env  []string

	mu          sync.Mutex
	cmd         *exec.Cmd
	done        chan struct{}
	incarnation int
	expectExit  bool
	logs        []string
}

func (h *harness) newProc(name string, env map[string]string) *proc {
	p := &proc{h: h, name: name, env: append(os.Environ(), "CHAOS_NAME="+name)}
	for k, v := range env {
		p.env = append(p.env, k+"="+v)
	}
	return p
}

// start starts a new incarnation of the process.
func (p *proc) start() {
	t := p.h.t
	t.Helper()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.incarnation++
	logPath := filepath.Join(p.h.logDir, fmt.Sprintf("%s.%d.log", p.name, p.incarnation))
	f, err := os.Create(logPath)
	require.NoError(t, err)
	cmd := exec.Command(p.h.bin)
	cmd.Env = p.env
	cmd.Stdout, cmd.Stderr = f, f
	require.NoError(t, cmd.Start(), "starting %s", p.name)
	done := make(chan struct{})
	p.cmd, p.done, p.expectExit = cmd, done, false
	p.logs = append(p.logs, logPath)
	inc := p.incarnation
	go func() {
		err := cmd.Wait()
		_ = f.Close()
		p.mu.Lock()
		if !p.expectExit {
			p.h.unexpectedExit(fmt.Sprintf("%s (incarnation %d, pid %d): %v; log %s", p.name, inc, cmd.Process.Pid, err, logPath))
		}
		p.mu.Unlock()
		close(done)
	}()
}

// signal sends sig to the current incarnation and waits (bounded) for it
// to exit; it reports whether it exited in time.
func (p *proc) signal(sig syscall.Signal, wait time.Duration) bool {
	p.mu.Lock()
	cmd, done := p.cmd, p.done
	p.expectExit = true
	p.mu.Unlock()
	if cmd == nil {
		return true
	}
	_ = cmd.Process.Signal(sig)
	select {
	case <-done:
		return true
	case <-time.After(wait):
		return false
	}
}

// signalOnly sends sig to the current incarnation, if it runs, without
// expecting it to exit (SIGSTOP, SIGCONT). It reports whether it was sent.
func (p *proc) signalOnly(sig syscall.Signal) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cmd == nil || p.expectExit {
		return false
	}
	select {
	case <-p.done:
		return false
	default:
	}
	return p.cmd.Process.Signal(sig) == nil
}

// kill SIGKILLs the current incarnation.
func (p *proc) kill() {
	require.True(p.h.t, p.signal(syscall.SIGKILL, 10*time.Second), "%s did not die within 10s of SIGKILL", p.name)
}

// stop stops the current incarnation gracefully (SIGTERM), or, after 30s,
// makes it dump its goroutines into its log (SIGQUIT: the Go runtime prints
// every stack and exits) and kills it; it reports whether the graceful stop
// worked.
func (p *proc) stop() bool {
	if p.signal(syscall.SIGTERM, 30*time.Second) {
		return true
	}
	p.h.t.Logf("%s did not stop within 30s of SIGTERM: its goroutines are dumped into its log", p.name)
	if p.signal(syscall.SIGQUIT, 10*time.Second) {
		return false
	}
	p.kill()
	return false
}

// exited reports whether the current incarnation has exited.
func (p *proc) exited() bool {
	p.mu.Lock()
	done := p.done
	p.mu.Unlock()
	select {
	case <-done:
		return true
	default:
		return false
	}
}

// tailLast returns the last n lines of each of the process's last k logs
// (one per incarnation).
func (p *proc) tailLast(k, n int) string {
	p.mu.Lock()
	logs := slices.Clone(p.logs[max(0, len(p.logs)-k):])
	p.mu.Unlock()
	var b strings.Builder
	for _, path := range logs {
		f, err := os.Open(path)
		if err != nil {
			continue
		}
		var lines []string
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64*1024), 1024*1024)
		for sc.Scan() {
			lines = append(lines, sc.Text())
		}
		_ = f.Close()
		fmt.Fprintf(&b, "--- %s (%d lines, last %d)\n", path, len(lines), min(n, len(lines)))
		for _, l := range lines[max(0, len(lines)-n):] {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

func (h *harness) unexpectedExit(what string) {
	h.exitMu.Lock()
	defer h.exitMu.Unlock()
	h.exits = append(h.exits, what)
}

// reviveCrashed restarts a worker that exited on its own (it is reported
// as an unexpected exit), so that the run can still settle and show its
// table.
func (h *harness) reviveCrashed() {
	for _, p := range h.procs() {
		p.mu.Lock()
		crashed := !p.expectExit && p.done != nil
		p.mu.Unlock()
		if crashed && p.exited() {
			p.start()
		}
	}
}

func (h *harness) procs() []*proc {
	ps := slices.Clone(h.consumers)
	for _, p := range []*proc{h.relay, h.downstream} {
		if p != nil { // none in a lease@redis run
			ps = append(ps, p)
		}
	}
	return ps
}

// ---------------------------------------------------------------------------
// The input: unique messages, duplicate copies, the fault plan.

// copyRec is one published copy of an input message.
type copyRec struct {
	Key string
	pos float64
}

// planInput draws, from the run's random source, which keys panic or are
// slow once, and the order of the copies to publish (duplicates of slow keys
// right behind them, so that a copy is waiting when the lease expires; other
// duplicates either close behind, to race the first copy, or far behind, to
// meet a done key).
func (h *harness) planInput() {
	s := h.s
	h.keys = make([]string, s.Messages)
	h.plan = map[string]string{}
	counts := map[string]int{}
	for i := range h.keys {
		h.keys[i] = fmt.Sprintf("m%06d", i)
		switch r := h.rng.Float64(); {
		case r < s.PanicRate:
			h.plan[h.keys[i]] = "panic"
		case r < s.PanicRate+s.SlowRate:
			h.plan[h.keys[i]] = "slow"
		}
		counts[h.plan[h.keys[i]]]++
	}
	// At least Faults of each, spread over the run. Poison keys (whose
	// handler also writes outputs the broker refuses) are exactly Faults,
	// between 10% and 60% of the stream, with healthy traffic around them.
	for fi, fault := range []string{"panic", "slow", "poison"} {
		for j := 0; counts[fault] < s.Faults; j++ {
			i := (j*s.Messages/s.Faults + (2*fi+1)*s.Messages/(6*s.Faults)) % s.Messages
			if fault == "poison" {
				i = s.Messages/10 + j*s.Messages/(2*s.Faults)
			}
			for h.plan[h.keys[i]] != "" {
				i = (i + 1) % s.Messages
			}
			h.plan[h.keys[i]] = fault
			counts[fault]++
		}
	}

	copies := make([]copyRec, 0, s.Messages+int(float64(s.Messages)*s.DupRatio)+1)
	for i, k := range h.keys {
		copies = append(copies, copyRec{Key: k, pos: float64(i)})
	}
	dups := int(math.Round(float64(s.Messages) * s.DupRatio))
	var dupKeys []int
	for i, k := range h.keys {
		if h.plan[k] == "slow" && len(dupKeys) < dups {
			dupKeys = append(dupKeys, i)
		}
	}
	for _, i := range h.rng.Perm(s.Messages) {
		if len(dupKeys) >= dups {
			break
		}
		if h.plan[h.keys[i]] != "slow" {
			dupKeys = append(dupKeys, i)
		}
	}
	for n, i := range dupKeys {
		pos := float64(i) + 0.5
		switch {
		case h.plan[h.keys[i]] == "slow":
		case n%2 == 0:
			pos += h.rng.Float64() * 8
		default:
			pos += h.rng.Float64() * float64(s.Messages) / 4
		}
		copies = append(copies, copyRec{Key: h.keys[i], pos: pos})
	}
	slices.SortStableFunc(copies, func(a, b copyRec) int {
		switch {
		case a.pos < b.pos:
			return -1
		case a.pos > b.pos:
			return 1
		}
		return 0
	})
	h.copies = copies
	h.plannedFaults = counts
}

// publish publishes the copies directly to RabbitMQ (not through the proxy)
// with publisher confirms, in chunks spread over window. It returns when
// all are confirmed, or the first error. In a cluster run (conn nil) it
// connects to the nodes itself, and publishes a chunk again, on another
// node, when its connection was lost or a confirm did not come (node
// faults): more duplicate copies, which the inbox drops.
func (h *harness) publish(ctx context.Context, conn *amqp.Connection, window time.Duration) error {
	var ch *amqp.Channel
	node := 0
	open := func() error {
		if h.v.cluster() {
			if conn != nil {
				_ = conn.Close()
			}
			var err error
			if conn, err = dialCluster(ctx, h.rabbit, node%3+1); err != nil {
				return err
			}
			node++
		}
		var err error
		if ch, err = conn.Channel(); err != nil {
			return err
		}
		return ch.Confirm(false)
	}
	defer func() {
		if ch != nil {
			_ = ch.Close()
		}
		if h.v.cluster() && conn != nil {
			_ = conn.Close()
		}
	}()
	if err := open(); err != nil {
		return err
	}
	const chunks = 50
	per := (len(h.copies) + chunks - 1) / chunks
	start := time.Now()
	for c := 0; c*per < len(h.copies); c++ {
		at := start.Add(window * time.Duration(c) / chunks)
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Until(at)):
		}
		chunk := h.copies[c*per : min(len(h.copies), (c+1)*per)]
		for {
			err := h.publishChunk(ctx, ch, chunk)
			if err == nil {
				break
			}
			if !h.v.cluster() || ctx.Err() != nil {
				return err
			}
			h.republished.Add(int64(len(chunk)))
			h.t.Logf("publishing the input: %v; publishing the chunk again through another node", err)
			for {
				if err := open(); err == nil || ctx.Err() != nil {
					break
				}
				sleepCtx(ctx, 200*time.Millisecond)
			}
		}
		h.published.Add(int64(len(chunk)))
	}
	return nil
}

// publishChunk publishes copies on ch and waits for their confirms (in a
// cluster run at most 20 s: a node without a majority confirms nothing).
func (h *harness) publishChunk(ctx context.Context, ch *amqp.Channel, copies []copyRec) error {
	if h.v.cluster() {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, 20*time.Second)
		defer cancel()
	}
	var confirms []*amqp.DeferredConfirmation
	for _, cp := range copies {
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", h.in, false, false, amqp.Publishing{
			Headers:      amqp.Table{wamqp.DefaultMessageUUIDHeaderKey: cp.Key},
			DeliveryMode: amqp.Persistent,
			ContentType:  "application/json",
			Body:         []byte(`{"key":"` + cp.Key + `"}`),
		})
		if err != nil {
			return err
		}
		confirms = append(confirms, dc)
	}
	for _, dc := range confirms {
		ok, err := dc.WaitContext(ctx)
		if err != nil {
			return err
		}
		if !ok {
			return errors.New("RabbitMQ nacked a published message")
		}
	}
	return nil
}

// ---------------------------------------------------------------------------
// Faults.

// The fault kinds the scheduler injects (handler panics and slow handlers
// are injected by the workers, from the plan).
const (
	faultConsumerKill = "SIGKILL consumer"
	faultRelayKill    = "SIGKILL relay"
	faultPGTerminate  = "pg_terminate_backend"
	faultPGRefuse     = "PostgreSQL refusing"
	faultAMQPClose    = "RabbitMQ connections closed"
	// faultRelayOutage stops the relay (SIGSTOP) while a backlog builds,
	// resumes it, and cuts its RabbitMQ connection a moment later, while it
	// publishes that backlog: an outage that begins in the middle of a
	// batch. The broker comes back just long enough for the relay to
	// reconnect and publish again, and the outage begins anew mid-batch:
	// the rows that failed in the first outage fail again right after other
	// messages were accepted. A relay that blamed rows for failing while
	// others of their batch went through would quarantine healthy rows here.
	faultRelayOutage = "RabbitMQ outage mid-batch, twice (relay)"
)

// faultRedisRefuse makes Redis look down (lease@redis): the harness's
// proxy closes every live connection and refuses new ones for a while.
const faultRedisRefuse = "Redis refusing (connections cut)"

// The database faults of a MariaDB run: KILL of the workers' connections
// (found in information_schema.PROCESSLIST: the run's database), and the
// proxy refusing, as for PostgreSQL.
const (
	faultMyKill   = "KILL (MariaDB connections)"
	faultMyRefuse = "MariaDB refusing"
)

var scheduledKinds = []string{faultConsumerKill, faultRelayKill, faultPGTerminate, faultPGRefuse, faultAMQPClose, faultRelayOutage}

// redisKinds are the faults of a lease@redis run: no database, relay or
// downstream to fault.
var redisKinds = []string{faultConsumerKill, faultAMQPClose, faultRedisRefuse}

// mysqlKinds are the faults of a MariaDB run: scheduledKinds with the
// database's own.
var mysqlKinds = []string{faultConsumerKill, faultRelayKill, faultMyKill, faultMyRefuse, faultAMQPClose, faultRelayOutage}

// kinds are the fault kinds the run's scheduler injects: a cluster run's
// are those of its database, and the nodes' (rounds of node kills, a
// majority lost).
func (h *harness) kinds() []string {
	switch {
	case h.v.DB == dbRedis:
		return redisKinds
	case h.v.mysql() && h.v.cluster():
		return append(slices.Clone(mysqlKinds), faultNodeRound, faultMajority)
	case h.v.mysql():
		return mysqlKinds
	case h.v.cluster():
		return append(slices.Clone(scheduledKinds), faultNodeRound, faultMajority)
	}
	return scheduledKinds
}

// clusterKind reports whether kind is one of the cluster's node faults
// (scheduled ClusterFaults times, not Faults).
func clusterKind(kind string) bool { return kind == faultNodeRound || kind == faultMajority }

// amqpCutters are the ways to the broker the harness cuts for
// faultAMQPClose: the consumers' and downstream's proxy and the relay's, or
// in a cluster run every process's proxies to the three nodes.
func (h *harness) amqpCutters() []cutter {
	if h.v.cluster() {
		out := []cutter{h.relayLinks, h.downLinks}
		for _, l := range h.consumerLinks {
			out = append(out, l)
		}
		return out
	}
	return []cutter{h.amqpProxy, h.relayAMQPProxy}
}

// relayCutter is the relay's way to the broker.
func (h *harness) relayCutter() cutter {
	if h.v.cluster() {
		return h.relayLinks
	}
	return h.relayAMQPProxy
}

type faultStep struct {
	Kind   string
	Gap    time.Duration // before the fault
	Hold   time.Duration // refusal length, or pause before a restart
	Target int           // consumer index
	// Stop and Lag: for faultRelayOutage, how long the relay stays stopped
	// and how long after it resumes the outage begins; Up and Hold2, how
	// long the broker is back before the second outage, and its length.
	Stop, Lag, Up, Hold2 time.Duration
}

// planFaults draws the schedule: Faults steps of each kind in a random
// order, with random gaps and holds. It returns the steps and their total
// planned duration.
func (h *harness) planFaults() ([]faultStep, time.Duration) {
	var steps []faultStep
	var total time.Duration
	for _, kind := range h.kinds() {
		n := h.s.Faults
		if clusterKind(kind) {
			n = h.s.ClusterFaults
		}
		for range n {
			st := faultStep{Kind: kind, Gap: time.Duration(200+h.rng.IntN(500)) * time.Millisecond}
			switch kind {
			case faultConsumerKill:
				st.Target = h.rng.IntN(h.s.Consumers)
				st.Hold = time.Duration(200+h.rng.IntN(600)) * time.Millisecond
			case faultRelayKill:
				st.Hold = time.Duration(200+h.rng.IntN(600)) * time.Millisecond
			case faultPGRefuse, faultMyRefuse, faultRedisRefuse:
				st.Hold = time.Duration(1000+h.rng.IntN(1000)) * time.Millisecond
			case faultAMQPClose:
				st.Hold = time.Duration(800+h.rng.IntN(400)) * time.Millisecond
			case faultRelayOutage:
				st.Stop = time.Duration(300+h.rng.IntN(400)) * time.Millisecond
				st.Lag = time.Duration(2+h.rng.IntN(20)) * time.Millisecond
				st.Hold = time.Duration(800+h.rng.IntN(700)) * time.Millisecond
				st.Up = time.Duration(300+h.rng.IntN(300)) * time.Millisecond
				st.Hold2 = time.Duration(700+h.rng.IntN(500)) * time.Millisecond
				total += st.Stop + st.Lag + st.Up + st.Hold2
			case faultNodeRound:
				// Each node down this long, then restarted (~10 s here).
				st.Hold = time.Duration(500+h.rng.IntN(1000)) * time.Millisecond
				total += 3 * (12*time.Second + time.Second)
			case faultMajority:
				st.Target = h.rng.IntN(3) // the node left alone is Target+1
				total += clusterMajorityHold + 12*time.Second
			}
			steps = append(steps, st)
			total += st.Gap + st.Hold
		}
	}
	h.rng.Shuffle(len(steps), func(i, j int) { steps[i], steps[j] = steps[j], steps[i] })
	if h.v.cluster() && !h.s.clusterFaultsSet {
		// The compact schedule: the round (two nodes) before the majority
		// loss (the third node with one of them).
		r := slices.IndexFunc(steps, func(st faultStep) bool { return st.Kind == faultNodeRound })
		m := slices.IndexFunc(steps, func(st faultStep) bool { return st.Kind == faultMajority })
		if m < r {
			steps[r], steps[m] = steps[m], steps[r]
		}
	}
	return steps, total
}

// inject runs one step of the schedule.
func (h *harness) inject(ctx context.Context, st faultStep) {
	t := h.t
	pause := func(d time.Duration) {
		select {
		case <-ctx.Done():
		case <-time.After(d):
		}
	}
	pause(st.Gap)
	h.reviveCrashed()
	t.Logf("fault at %s: %s (hold %s)", time.Now().Format("15:04:05.000"), st.Kind, st.Hold)
	switch st.Kind {
	case faultConsumerKill:
		p := h.consumers[st.Target]
		p.kill()
		pause(st.Hold)
		p.start()
	case faultRelayKill:
		h.relay.kill()
		pause(st.Hold)
		h.relay.start()
	case faultPGTerminate:
		// Every worker holds pooled connections; retry shortly if none is
		// open at this instant (all just cut by a previous fault).
		for try := 0; ; try++ {
			var n int64
			require.NoError(t, h.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))
FROM pg_stat_activity WHERE application_name = ANY($1) AND pid <> pg_backend_pid()`, h.appNames()).Scan(&n))
			if n > 0 {
				h.terminated += n
				break
			}
			if try == 50 {
				t.Logf("pg_terminate_backend: no worker connection open after %d tries", try)
				return
			}
			pause(100 * time.Millisecond)
		}
	case faultMyKill:
		// As for pg_terminate_backend: retry shortly while no worker
		// connection is open.
		for try := 0; ; try++ {
			if n := h.killMySQL(ctx); n > 0 {
				h.terminated += n
				break
			}
			if try == 50 {
				t.Logf("KILL: no worker connection open after %d tries", try)
				return
			}
			pause(100 * time.Millisecond)
		}
	case faultPGRefuse, faultMyRefuse:
		h.dbProxy.Refuse()
		pause(st.Hold)
		h.dbProxy.Allow()
	case faultRedisRefuse:
		h.redisCut += int64(h.redisProxy.Stats().Live)
		h.redisProxy.Refuse()
		pause(st.Hold)
		h.redisProxy.Allow()
	case faultAMQPClose:
		for _, c := range h.amqpCutters() {
			h.amqpCut += int64(c.Stats().Live)
			c.Refuse()
		}
		pause(st.Hold)
		for _, c := range h.amqpCutters() {
			c.Allow()
		}
	case faultRelayOutage:
		if !h.relay.signalOnly(syscall.SIGSTOP) {
			return // the relay is not running (being restarted)
		}
		relay := h.relayCutter()
		pause(st.Stop)
		h.relay.signalOnly(syscall.SIGCONT)
		pause(st.Lag)
		h.amqpCut += int64(relay.Stats().Live)
		relay.Refuse()
		pause(st.Hold)
		relay.Allow()
		pause(st.Up)
		h.amqpCut += int64(relay.Stats().Live)
		relay.Refuse()
		pause(st.Hold2)
		relay.Allow()
	case faultNodeRound:
		h.cc.round(ctx, st.Hold)
	case faultMajority:
		h.cc.majority(ctx, st.Target+1)
	}
	h.injected[st.Kind]++
}

// killMySQL KILLs every connection of the workers to MariaDB and returns
// how many it killed. The workers' connections are those whose current
// database is the run's: their DSN names it (mysqlWorkerURL), while the
// harness's own sessions are on the server's default database and qualify
// the run's tables. (Their client address is the proxy's outgoing side, a
// port of its own per connection, which the proxy does not expose.)
func (h *harness) killMySQL(ctx context.Context) int64 {
	t := h.t
	var ids []int64
	rows, err := h.my.QueryContext(ctx, `SELECT id FROM information_schema.processlist
WHERE db = ? AND id <> CONNECTION_ID() AND command NOT IN ('Killed', 'Daemon')`, h.tables.Schema)
	require.NoError(t, err)
	for rows.Next() {
		var id int64
		require.NoError(t, rows.Scan(&id))
		ids = append(ids, id)
	}
	require.NoError(t, rows.Err())
	require.NoError(t, rows.Close())
	var n int64
	for _, id := range ids {
		// KILL takes no placeholder; id is a number the server gave.
		if _, err := h.my.ExecContext(ctx, "KILL CONNECTION "+strconv.FormatInt(id, 10)); err == nil {
			n++
		} else if !strings.Contains(err.Error(), "1094") { // Unknown thread id: it closed meanwhile
			t.Logf("KILL %d: %v", id, err)
		}
	}
	return n
}

// appNames are the application_names of the workers' connections.
func (h *harness) appNames() []string {
	return []string{"chaos-consumer-" + h.runID, "chaos-relay-" + h.runID, "chaos-downstream-" + h.runID}
}
