package chaos

// The cluster runs (mode+cluster in CHAOS_MODES and CHAOS_ORDERED_MODES):
// RabbitMQ is a three-node cluster (scripts/rabbit-cluster.sh) whose
// queues are all quorum queues, every worker knows the three nodes (in an
// order of its own, so that they sit on different nodes), and the faults
// are the nodes' own: each node SIGKILLed and restarted in turn (the
// leader of the run's queues first, then the node the relay is connected
// to), and a majority lost (two nodes SIGKILLed) for clusterMajorityHold,
// on top of the process and database faults of the other runs.

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// The chaos package's cluster: nodes eo-chaos1..3 on 127.0.0.1:5701..5703
// (EO_RMQ_PORT_BASE and EO_RMQ_NAME override them), beside the cluster of
// tests/cluster (5690), which `go test ./...` may run at the same time.
const (
	clusterBase = 5700
	clusterName = "eo-chaos"
)

// clusterMajorityHold is how long a majority stays lost.
const clusterMajorityHold = 10 * time.Second

// quorum is how every queue of a cluster run is declared.
var quorum = rabbitmq.Queues{Type: rabbitmq.Quorum}

// The cluster is started once per test binary, by the first cluster run, or
// ahead of it, in the background, by TestMain when the selected runs hold
// one (the ~30 s start then overlaps the runs before); TestMain stops it.
var cluster struct {
	once    sync.Once
	started atomic.Bool
	done    chan struct{}
	c       *testenv.RabbitCluster
	err     error
	took    time.Duration
}

func init() { cluster.done = make(chan struct{}) }

// startClusterAsync starts the cluster in the background (once).
func startClusterAsync() {
	cluster.once.Do(func() {
		cluster.started.Store(true)
		go func() {
			defer close(cluster.done)
			start := time.Now()
			cluster.c, cluster.err = testenv.StartRabbitCluster(clusterBase, clusterName)
			cluster.took = time.Since(start)
		}()
	})
}

// rabbitCluster returns the cluster with its three nodes running (a run that
// failed may have left one down: the start is idempotent).
func rabbitCluster(t *testing.T) *testenv.RabbitCluster {
	t.Helper()
	startClusterAsync()
	<-cluster.done
	require.NoError(t, cluster.err, "starting the three-node RabbitMQ cluster (`make services` installs RabbitMQ)")
	t.Logf("RabbitMQ cluster started in %s (once per test binary)", cluster.took.Round(time.Millisecond))
	_, err := testenv.StartRabbitCluster(clusterBase, clusterName)
	require.NoError(t, err, "the three nodes running before the run")
	return cluster.c
}

// stopCluster stops the cluster if it was started (EO_CLUSTER_KEEP keeps it).
func stopCluster() {
	if !cluster.started.Load() {
		return
	}
	<-cluster.done
	if cluster.c == nil || os.Getenv("EO_CLUSTER_KEEP") != "" {
		return
	}
	if err := cluster.c.Stop(); err != nil {
		fmt.Fprintf(os.Stderr, "chaos: stopping the RabbitMQ cluster: %v\n", err)
	}
}

// clusterSelected reports whether the runs TestMain is about to run hold a
// cluster run: CHAOS_MODES or CHAOS_ORDERED_MODES (or their defaults), with
// a -run pattern, if any, naming TestChaos or TestChaosOrdered.
func clusterSelected(runPattern string) bool {
	top, _, _ := strings.Cut(runPattern, "/")
	matches := func(name string) bool {
		if top == "" {
			return true
		}
		for alt := range strings.SplitSeq(top, "|") {
			alt = strings.Trim(alt, "^$()")
			if alt != "" && strings.Contains(name, strings.TrimSuffix(alt, "$")) {
				return true
			}
		}
		return false
	}
	modes := os.Getenv("CHAOS_MODES")
	if modes == "" {
		modes = defaultRuns
	}
	ordered := os.Getenv("CHAOS_ORDERED_MODES")
	if ordered == "" {
		ordered = defaultOrderedRuns
	}
	return (matches("TestChaos") && strings.Contains(modes, "+"+subCluster)) ||
		(matches("TestChaosOrdered") && strings.Contains(ordered, "+"+subCluster))
}

// nodeLinks are one worker process's ways to the cluster: a TCP proxy per
// node, so that the harness sees which node the process is connected to
// (the proxy with live connections) and can cut its connections as it
// does those of a single broker.
type nodeLinks struct {
	c       *testenv.RabbitCluster
	proxies [3]*testenv.Proxy
}

func newNodeLinks(t *testing.T, c *testenv.RabbitCluster) *nodeLinks {
	l := &nodeLinks{c: c}
	for n := 1; n <= 3; n++ {
		l.proxies[n-1] = testenv.NewProxy(t, hostPort(t, c.URL(n), "5672"))
	}
	return l
}

// urls are the three nodes' URLs through the proxies, from node first on.
func (l *nodeLinks) urls(first int) []string {
	var out []string
	for i := range 3 {
		n := (first-1+i)%3 + 1
		out = append(out, l.proxies[n-1].RewriteURL(l.c.URL(n)))
	}
	return out
}

// nodes are the nodes the process has live connections to.
func (l *nodeLinks) nodes() []int {
	var out []int
	for i, p := range l.proxies {
		if p.Stats().Live > 0 {
			out = append(out, i+1)
		}
	}
	return out
}

// Refuse, Allow and Stats make the three proxies one (a cutter).
func (l *nodeLinks) Refuse() {
	for _, p := range l.proxies {
		p.Refuse()
	}
}

func (l *nodeLinks) Allow() {
	for _, p := range l.proxies {
		p.Allow()
	}
}

func (l *nodeLinks) Stats() testenv.ProxyStats {
	var s testenv.ProxyStats
	for _, p := range l.proxies {
		ps := p.Stats()
		s.Accepted += ps.Accepted
		s.Refused += ps.Refused
		s.Live += ps.Live
	}
	return s
}

// cutter is a way to a broker the harness can cut: a proxy, or a
// process's nodeLinks.
type cutter interface {
	Refuse()
	Allow()
	Stats() testenv.ProxyStats
}

// The cluster faults (counted per run in clusterChaos.counts).
const (
	faultNodeRound     = "RabbitMQ nodes SIGKILLed and restarted one at a time, each in turn (rounds)"
	faultNodeKill      = "  node SIGKILLs"
	faultLeaderKill    = "  of the leader of the queues (the first of a round)"
	faultRelayNodeKill = "  of the node the relay was connected to"
	faultConsNodeKill  = "  of a node a consumer was connected to"
	faultMajority      = "majority lost (two nodes SIGKILLed, restarted after 10s)"
)

// clusterKinds are the cluster faults each run checks, each at least
// ClusterFaults times.
var clusterKinds = []string{faultNodeRound, faultLeaderKill, faultRelayNodeKill, faultConsNodeKill, faultMajority}

// clusterChaos injects the node faults of one run.
//
// compact is the short form's schedule (CHAOS_CLUSTER_FAULTS not set): a
// round kills two nodes one at a time (the leader of the queues, then the
// relay's node), and the majority loss that follows takes the third with
// one of them, so that each node is still SIGKILLed in turn, the leader
// and the relay's node alone, in three restarts instead of five (a
// restart is 10-25 s on the loaded 2-core machine).
type clusterChaos struct {
	t       *testing.T
	c       *testenv.RabbitCluster
	compact bool
	// leader is the node whose kill opens a round: the leader of the run's
	// queues as the cluster sees them now (0: none found).
	leader func() int
	// relays and consumers are the processes' ways to the cluster.
	relays, consumers []*nodeLinks

	mu     sync.Mutex
	counts map[string]int
	killed [4]int // SIGKILLs per node (1..3)
}

// coverage reports the SIGKILLs of each node, and whether each was killed.
func (cc *clusterChaos) coverage() (string, bool) {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	all := true
	var parts []string
	for n := 1; n <= 3; n++ {
		parts = append(parts, fmt.Sprintf("node %d: %d", n, cc.killed[n]))
		all = all && cc.killed[n] > 0
	}
	return strings.Join(parts, ", "), all
}

func (cc *clusterChaos) count(kind string) {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if cc.counts == nil {
		cc.counts = map[string]int{}
	}
	cc.counts[kind]++
}

func (cc *clusterChaos) counted() map[string]int {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	out := map[string]int{}
	for k, v := range cc.counts {
		out[k] = v
	}
	return out
}

// connected returns the nodes the given processes are connected to.
func connected(links []*nodeLinks) []int {
	var out []int
	for _, l := range links {
		for _, n := range l.nodes() {
			if !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
	}
	slices.Sort(out)
	return out
}

// kill SIGKILLs node n, counting what was on it.
func (cc *clusterChaos) kill(n int, first bool, leader int) {
	relays, consumers := connected(cc.relays), connected(cc.consumers)
	require.NoError(cc.t, cc.c.Kill(n), "SIGKILL of node %d", n)
	cc.count(faultNodeKill)
	cc.mu.Lock()
	cc.killed[n]++
	cc.mu.Unlock()
	what := []string{}
	if first && n == leader {
		cc.count(faultLeaderKill)
		what = append(what, "the leader")
	}
	if slices.Contains(relays, n) {
		cc.count(faultRelayNodeKill)
		what = append(what, "the relay's node")
	}
	if slices.Contains(consumers, n) {
		cc.count(faultConsNodeKill)
		what = append(what, "a consumer's node")
	}
	cc.t.Logf("cluster fault at %s: node %d SIGKILLed (%s; relays on %v, consumers on %v)",
		time.Now().Format("15:04:05.000"), n, strings.Join(what, ", "), relays, consumers)
}

// start starts node n again and waits until it listens.
func (cc *clusterChaos) start(n int) {
	start := time.Now()
	require.NoError(cc.t, cc.c.Start(n), "restarting node %d", n)
	cc.t.Logf("cluster: node %d back in %s", n, time.Since(start).Round(time.Millisecond))
}

// round SIGKILLs each node in turn, restarting it (after down) before the
// next: first the leader of the run's queues, then the node a relay is
// connected to, then the other (compact: not the other, see clusterChaos).
func (cc *clusterChaos) round(ctx context.Context, down time.Duration) {
	nodes := 3
	if cc.compact {
		nodes = 2
	}
	leader := cc.leader()
	var killed []int
	next := func() int {
		candidates := []int{leader}
		candidates = append(candidates, connected(cc.relays)...)
		candidates = append(candidates, 1, 2, 3)
		for _, n := range candidates {
			if n >= 1 && n <= 3 && !slices.Contains(killed, n) {
				return n
			}
		}
		return 0
	}
	for len(killed) < nodes && ctx.Err() == nil {
		n := next()
		cc.kill(n, len(killed) == 0, leader)
		killed = append(killed, n)
		sleepCtx(ctx, down)
		cc.start(n)
		// The restarted node's queue members catch up before the next
		// node goes (killing it now could lose a majority).
		sleepCtx(ctx, time.Second)
	}
	cc.count(faultNodeRound)
}

// majority SIGKILLs the two nodes other than keep, and restarts them
// clusterMajorityHold later (both at once). Compact: keep is a node killed
// before, so that the one never killed goes down.
func (cc *clusterChaos) majority(ctx context.Context, keep int) {
	if cc.compact {
		cc.mu.Lock()
		for n := 1; n <= 3; n++ {
			if cc.killed[n] == 0 {
				keep = n%3 + 1
				if cc.killed[keep] == 0 {
					keep = keep%3 + 1
				}
				break
			}
		}
		cc.mu.Unlock()
	}
	var down []int
	for n := 1; n <= 3; n++ {
		if n != keep {
			cc.kill(n, false, 0)
			down = append(down, n)
		}
	}
	cc.t.Logf("cluster fault: majority lost (nodes %v down, node %d alone) for %s", down, keep, clusterMajorityHold)
	sleepCtx(ctx, clusterMajorityHold)
	var wg sync.WaitGroup
	for _, n := range down {
		wg.Go(func() { cc.start(n) })
	}
	wg.Wait()
	cc.count(faultMajority)
}

func sleepCtx(ctx context.Context, d time.Duration) {
	select {
	case <-ctx.Done():
	case <-time.After(d):
	}
}

// leaderByQueues returns the node leading the most of the queues whose name
// starts with prefix (0 when the cluster cannot say).
func leaderByQueues(t *testing.T, c *testenv.RabbitCluster, prefix string) int {
	qs, err := c.Queues(prefix)
	if err != nil {
		t.Logf("cluster: listing the queues: %v", err)
		return 0
	}
	per := map[int]int{}
	best := 0
	for _, q := range qs {
		n := c.LeaderNode(q)
		if n == 0 {
			continue
		}
		per[n]++
		if best == 0 || per[n] > per[best] {
			best = n
		}
	}
	return best
}

// clusterQueues declares queues named prefix+... as quorum queues, queue i
// through node i%3+1 (a quorum queue's leader starts on the node that
// declared it: the run's leaders are spread), and deletes them at cleanup.
func clusterQueues(t *testing.T, c *testenv.RabbitCluster, names []string, partitionArgs bool) {
	t.Helper()
	for i, name := range names {
		conn, err := amqp.Dial(c.URL(i%3 + 1))
		require.NoError(t, err)
		ch, err := conn.Channel()
		require.NoError(t, err)
		args := quorum.Arguments()
		if partitionArgs {
			args = quorum.PartitionArguments()
		}
		_, err = ch.QueueDeclare(name, true, false, false, false, args)
		require.NoError(t, err, "declaring %s", name)
		_ = conn.Close()
	}
	t.Cleanup(func() {
		conn, err := dialCluster(context.Background(), c, 1)
		if err != nil {
			t.Errorf("deleting the run's queues: %v", err)
			return
		}
		defer func() { _ = conn.Close() }()
		ch, err := conn.Channel()
		if err != nil {
			t.Errorf("deleting the run's queues: %v", err)
			return
		}
		for _, name := range names {
			_, _ = ch.QueueDelete(name, false, false, false)
		}
	})
}

// dialCluster connects to the first node that answers, from node first on;
// while none does (a majority lost: the last node paused), it tries again
// until ctx ends.
func dialCluster(ctx context.Context, c *testenv.RabbitCluster, first int) (*amqp.Connection, error) {
	var lastErr error
	for {
		for _, u := range c.URLs(first) {
			conn, err := amqp.DialConfig(u, amqp.Config{Dial: amqp.DefaultDial(3 * time.Second)})
			if err == nil {
				return conn, nil
			}
			lastErr = err
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("no node of the cluster answers: %w", lastErr)
		case <-time.After(200 * time.Millisecond):
		}
	}
}
