package cluster_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// quorum is how every queue of these tests is declared.
var quorum = rabbitmq.Queues{Type: rabbitmq.Quorum}

// testCtx is a context for t, ended after d or when t ends.
func testCtx(t *testing.T, d time.Duration) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// dialNode dials the first running node of urls, with a short timeout.
func dialNode(urls ...string) (*amqp091.Connection, error) {
	var err error
	for _, u := range urls {
		var conn *amqp091.Connection
		if conn, err = amqp091.DialConfig(u, amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)}); err == nil {
			return conn, nil
		}
	}
	return nil, err
}

// clusterQueue is a unique queue name, the queues named deleted when t ends
// (through any node that answers: the test left all three running).
func clusterQueue(t *testing.T, role string) string {
	t.Helper()
	name := testenv.Unique(t, "eo_cl_"+role+"_")
	t.Cleanup(func() { deleteQueues(t, name) })
	return name
}

func deleteQueues(t *testing.T, names ...string) {
	// A quorum queue is deleted only with a majority: the nodes a failed
	// test left down first.
	if err := startDown(); err != nil {
		t.Errorf("starting nodes again: %v", err)
	}
	conn, err := dialNode(rabbit.URLs(1)...)
	if err != nil {
		t.Logf("deleting queues %v: %v", names, err)
		return
	}
	defer func() { _ = conn.Close() }()
	for _, name := range names {
		ch, err := conn.Channel()
		if err != nil {
			t.Logf("deleting queue %s: %v", name, err)
			return
		}
		_, _ = ch.QueueDelete(name, false, false, false)
		_ = ch.Close()
	}
}

// nodes kills nodes of the cluster and starts them again; whatever is down
// when the test ends is started then (or before its queues are deleted),
// so that the next test finds three running nodes.
type nodes struct{ t *testing.T }

var (
	downMu sync.Mutex
	down   = map[int]bool{} // nodes killed and not started again
)

func clusterNodes(t *testing.T) *nodes {
	t.Cleanup(func() {
		if err := startDown(); err != nil {
			t.Errorf("starting nodes again: %v", err)
		}
	})
	return &nodes{t: t}
}

// startDown starts the nodes killed and not started again.
func startDown() error {
	downMu.Lock()
	defer downMu.Unlock()
	var ks []int
	for k := range down {
		ks = append(ks, k)
	}
	if len(ks) == 0 {
		return nil
	}
	if err := startNodes(ks...); err != nil {
		return err
	}
	clear(down)
	return nil
}

// kill kills the nodes, one after the other (a crash: SIGKILL).
func (n *nodes) kill(ks ...int) {
	n.t.Helper()
	downMu.Lock()
	defer downMu.Unlock()
	for _, k := range ks {
		require.NoError(n.t, rabbit.Kill(k))
		down[k] = true
	}
}

// start starts the nodes again, at the same time, and returns once each
// listens for AMQP; it returns how long that took.
func (n *nodes) start(ks ...int) time.Duration {
	n.t.Helper()
	downMu.Lock()
	defer downMu.Unlock()
	t0 := time.Now()
	require.NoError(n.t, startNodes(ks...))
	for _, k := range ks {
		delete(down, k)
	}
	return time.Since(t0)
}

func startNodes(ks ...int) error {
	errs := make([]error, len(ks))
	var wg sync.WaitGroup
	for i, k := range ks {
		wg.Go(func() { errs[i] = rabbit.Start(k) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// leaderOf waits until queue has a leader and returns its node.
func leaderOf(t *testing.T, queue string) int {
	t.Helper()
	leader := 0
	testenv.Eventually(t, time.Minute, func() bool {
		qs, err := rabbit.Queues(queue)
		if err != nil || len(qs) != 1 {
			return false
		}
		leader = rabbit.LeaderNode(qs[0])
		return leader != 0
	}, "queue %s has a leader", queue)
	return leader
}

// otherThan is the lowest node that is none of ns.
func otherThan(ns ...int) int {
	for k := 1; k <= 3; k++ {
		found := false
		for _, n := range ns {
			found = found || n == k
		}
		if !found {
			return k
		}
	}
	return 0
}

func newPublisher(t *testing.T, cfg rabbitmq.PublisherConfig) *rabbitmq.Publisher {
	t.Helper()
	p, err := rabbitmq.NewPublisher(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

func newSubscriber(t *testing.T, cfg rabbitmq.SubscriberConfig) *rabbitmq.Subscriber {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = testenv.Logger(t)
	}
	s, err := rabbitmq.NewSubscriber(cfg)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// newMessages are n messages with UUIDs prefix-00000, prefix-00001, ...
func newMessages(prefix string, from, n int) []*message.Message {
	out := make([]*message.Message, n)
	for i := range out {
		out[i] = message.NewMessage(fmt.Sprintf("%s-%05d", prefix, from+i), []byte(fmt.Sprintf(`{"i":%d}`, from+i)))
	}
	return out
}

func toTopic(topic string, msgs []*message.Message) []msgid.TopicMessage {
	out := make([]msgid.TopicMessage, len(msgs))
	for i, m := range msgs {
		out[i] = msgid.TopicMessage{Topic: topic, Message: m}
	}
	return out
}

// publishAll publishes msgs until each was confirmed (all nodes are up:
// a failure is unexpected and fails t).
func publishAll(t *testing.T, ctx context.Context, pub *rabbitmq.Publisher, batch []msgid.TopicMessage) {
	t.Helper()
	for i, err := range pub.PublishBatch(ctx, batch) {
		require.NoError(t, err, "message %d", i)
	}
}

// drain consumes every message of queue through node via and counts them
// by UUID.
func drain(t *testing.T, queue string, via int) map[string]int {
	t.Helper()
	conn, err := dialNode(rabbit.URL(via))
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	require.NoError(t, err)
	got := map[string]int{}
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	require.NoError(t, err)
	if q.Messages == 0 {
		return got
	}
	require.NoError(t, ch.Qos(1000, 0, false))
	deliveries, err := ch.Consume(queue, "", false, false, false, false, nil)
	require.NoError(t, err)
	timeout := time.After(30 * time.Second)
	for k := 1; k <= q.Messages; k++ {
		select {
		case d := <-deliveries:
			m, err := rabbitmq.Marshaler{}.Unmarshal(d)
			require.NoError(t, err)
			got[m.UUID]++
			if k%500 == 0 || k == q.Messages {
				require.NoError(t, d.Ack(true))
			}
		case <-timeout:
			require.FailNow(t, "queue not drained", "%s: %d messages expected, got %d", queue, q.Messages, k-1)
		}
	}
	return got
}

// counter counts deliveries by UUID, and the time of each.
type counter struct {
	mu    sync.Mutex
	count map[string]int
	at    []time.Time
}

func newCounter() *counter { return &counter{count: map[string]int{}} }

func (c *counter) add(uuid string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.count[uuid]++
	c.at = append(c.at, time.Now())
}

// has reports whether each of uuids was delivered.
func (c *counter) has(uuids []string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, u := range uuids {
		if c.count[u] == 0 {
			return false
		}
	}
	return true
}

func (c *counter) distinct() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.count)
}

// repeats is the number of deliveries beyond the first, over every UUID.
func (c *counter) repeats() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, k := range c.count {
		n += k - 1
	}
	return n
}

// gapAfter is the longest time between two deliveries after t0 (the first
// one after t0 counted from t0): how long the stream stopped.
func (c *counter) gapAfter(t0 time.Time) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	var gap time.Duration
	prev := t0
	for _, at := range c.at {
		if at.Before(t0) {
			continue
		}
		gap = max(gap, at.Sub(prev))
		prev = at
	}
	return gap
}

// since is the number of deliveries after t0.
func (c *counter) since(t0 time.Time) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, at := range c.at {
		if at.After(t0) {
			n++
		}
	}
	return n
}

// consume acks every message of msgs after hold, counting it in c.
func consume(msgs <-chan *message.Message, c *counter, hold time.Duration) {
	go func() {
		for m := range msgs {
			c.add(m.UUID)
			go func() {
				time.Sleep(hold)
				m.Ack()
			}()
		}
	}()
}

// writeRows writes n outbox rows to topic in one transaction and returns
// their UUIDs.
func writeRows(t *testing.T, ctx context.Context, db sqlschema.DB, prefix string, n int, topic string) []string {
	t.Helper()
	w, err := outbox.NewWriter(db)
	require.NoError(t, err)
	tx, err := db.Conn.BeginTx(ctx, nil)
	require.NoError(t, err)
	pub, err := w.Publisher(tx)
	require.NoError(t, err)
	var uuids []string
	for _, m := range newMessages(prefix, 0, n) {
		require.NoError(t, pub.Publish(topic, m))
		uuids = append(uuids, m.UUID)
	}
	require.NoError(t, tx.Commit())
	return uuids
}

// runRelay runs relay until the test ends.
func runRelay(t *testing.T, relay *outbox.Relay) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- relay.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("Relay.Run did not return within 30s after cancel")
		}
	})
}

func pending(t *testing.T, db sqlschema.DB) outbox.Pending {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	p, err := testenv.OutboxStore(t, db).Pending(ctx)
	require.NoError(t, err)
	return p
}

// errorKinds counts errors by their text with the message names cut out.
func errorKinds(errs []error) string {
	kinds := map[string]int{}
	for _, err := range errs {
		s := err.Error()
		if i := strings.Index(s, " message \""); i >= 0 {
			if j := strings.Index(s[i+10:], "\""); j >= 0 {
				s = s[:i] + " message X" + s[i+10+j+1:]
			}
		}
		if len(s) > 200 {
			s = s[:200] + "..."
		}
		kinds[s]++
	}
	var out []string
	for s, n := range kinds {
		out = append(out, fmt.Sprintf("%dx %s", n, s))
	}
	sort.Strings(out)
	return strings.Join(out, "\n\t")
}

// setPartitionHandling sets node n's cluster_partition_handling while it
// runs (scripts/rabbit-cluster.sh configures pause_minority; RabbitMQ's
// default is ignore). A node started again reads its configuration file.
func setPartitionHandling(t *testing.T, n int, mode string) {
	t.Helper()
	name := os.Getenv("EO_RMQ_NAME")
	if name == "" {
		name = "eo-rmq"
	}
	out, err := exec.Command("runuser", "-u", "rabbitmq", "--", "env", "HOME=/var/lib/rabbitmq",
		"/usr/lib/rabbitmq/bin/rabbitmqctl", "-n", fmt.Sprintf("%s%d@localhost", name, n), "eval",
		fmt.Sprintf("application:set_env(rabbit, cluster_partition_handling, %s).", mode)).CombinedOutput()
	require.NoError(t, err, "rabbitmqctl eval: %s", out)
}

// recorder is a Publisher whose failures are recorded from a moment on.
type recorder struct {
	*rabbitmq.Publisher
	mu    sync.Mutex
	on    bool
	errs  []error
	calls int
}

func (r *recorder) PublishBatch(ctx context.Context, batch []msgid.TopicMessage) []error {
	errs := r.Publisher.PublishBatch(ctx, batch)
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.on {
		r.calls++
		for _, err := range errs {
			if err != nil {
				r.errs = append(r.errs, err)
			}
		}
	}
	return errs
}

// record starts recording and returns what was recorded since the last
// call.
func (r *recorder) record() (calls int, errs []error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	calls, errs = r.calls, r.errs
	r.on, r.calls, r.errs = true, 0, nil
	return calls, errs
}
