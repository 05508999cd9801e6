package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// The broker section (issue 32): the library's two broker paths, the outbox
// relay publishing through rabbitmq.Publisher and a router consuming with
// the middleware through rabbitmq.Subscriber, on the setups of -broker-setups:
//
//   - classic: the single node (AMQP_URL) with classic queues, the baseline
//     every line compares with;
//   - quorum: the single node with quorum queues (a Raft group of one);
//   - cluster: a local three-node cluster (scripts/rabbit-cluster.sh, AMQP
//     on 127.0.0.1:5711..5713, nodes eo-bench1..3; EO_RMQ_PORT_BASE and
//     EO_RMQ_NAME override) with quorum queues (three members), every
//     client (relay, subscriber, pre-fill) connected to the node that leads
//     the queues: the best case for a cluster;
//   - cluster-spread: the same cluster and queue type, the relay's publisher
//     (and the pre-fill) connected to one follower and the subscriber to the
//     other: each message enters and leaves through nodes that forward to
//     the leader, as with clients spread over the nodes by a load balancer.
//
// The cluster's queues are declared through node 1 (RabbitMQ 3.10 places a
// quorum queue's leader on the declaring client's node); the section reads
// their leader back (rabbitmqctl) and connects each setup's clients
// relative to it. The section starts the cluster when none of its nodes
// answers, and stops it (removing its data) at the end; a cluster found
// running is left running, and only this run's queues are deleted from it.
//
// Each setup has its own two queues. A round runs every variant, and within
// a variant every setup back to back (both orders rotating from round to
// round), so that what a line compares was measured minutes apart at most:
//
//   - relay, W workers (-broker-relay-workers): the outbox holds
//     -broker-rows rows for the setup's relay queue (filled in SQL, outside
//     the timing); outbox.Relay (BatchSize -relay-batch, Workers W) drains it
//     through the setup's rabbitmq.Publisher (window -window), timed until
//     every row is relayed (or -relay-time); the queue then holds them all;
//   - per-message, group commit + Exec: the setup's router queue is
//     pre-filled with -broker-messages messages (confirmed), then a fresh
//     router drains it with the middleware and the router section's business
//     INSERT (per-message: PgxTxFromContext, prefetch -prefetch; group commit
//     + Exec: Config.Batch, prefetch -batch-prefetch), timed from the first
//     delivery to the last success; then every message has its business row
//     and its inbox record.
//
// PostgreSQL only (the broker is what differs): one schema, the router
// section's pool of -pool connections for the handlers and the relay.

// brokerSetupKeys are the setups -broker-setups may name, in the order
// they print.
var brokerSetupKeys = []string{"classic", "quorum", "cluster", "cluster-spread"}

// The bench's own cluster: testenv.StartRabbitCluster's base and name,
// which EO_RMQ_PORT_BASE and EO_RMQ_NAME override.
const (
	brokerClusterBase = 5710
	brokerClusterName = "eo-bench"
)

func parseBrokerSetups(s string) ([]string, error) {
	seen := map[string]bool{}
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		if f == "" {
			continue
		}
		known := false
		for _, k := range brokerSetupKeys {
			known = known || k == f
		}
		if !known {
			return nil, fmt.Errorf("-broker-setups: unknown setup %q (%s)", f, strings.Join(brokerSetupKeys, ", "))
		}
		if seen[f] {
			return nil, fmt.Errorf("-broker-setups: %s given twice", f)
		}
		seen[f] = true
	}
	if !seen["classic"] || len(seen) < 2 {
		return nil, fmt.Errorf("-broker-setups: want classic (the baseline) and at least one other, got %q", s)
	}
	var out []string
	for _, k := range brokerSetupKeys {
		if seen[k] {
			out = append(out, k)
		}
	}
	return out, nil
}

// brokerSetup is one broker setup of the section: where its clients
// connect, how its queues are declared, its queues and its publisher.
type brokerSetup struct {
	key     string
	name    string // in the table
	queues  rabbitmq.Queues
	cluster bool
	pubURLs []string // the relay's publisher and the pre-fill: first, then the others
	subURLs []string // the router's subscriber

	conn        *amqp.Connection // to pubURLs[0]: pre-fills, purges, depths
	ch          *amqp.Channel
	relayQueue  string
	routerQueue string
	pub         *rabbitmq.Publisher
}

func (s *brokerSetup) close() {
	if s.pub != nil {
		_ = s.pub.Close()
	}
	if s.conn != nil {
		_ = s.conn.Close()
	}
}

// brokerVariant is a measurement of the section: the relay with
// relayWorkers workers, or (relayWorkers 0) a router mode.
type brokerVariant struct {
	relayWorkers int
	mode         routerVariant
}

func (v brokerVariant) String() string {
	switch {
	case v.relayWorkers > 0:
		return fmt.Sprintf("relay, %d %s", v.relayWorkers, plural(v.relayWorkers, "worker"))
	case v.mode == groupCommitExec:
		return "group commit + Exec" // the router section prints it by its former name
	}
	return string(v.mode)
}

func plural(n int, s string) string {
	if n == 1 {
		return s
	}
	return s + "s"
}

// brokerCluster starts the bench's cluster unless one of its nodes already
// answers; stop stops it at the end if this run started it.
func brokerCluster() (c *testenv.RabbitCluster, stop func(), err error) {
	base := brokerClusterBase
	if v, err := strconv.Atoi(os.Getenv("EO_RMQ_PORT_BASE")); err == nil && v > 0 {
		base = v // as StartRabbitCluster reads it
	}
	running := false
	for n := 1; n <= 3; n++ {
		conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", base+n), 500*time.Millisecond)
		if err == nil {
			_ = conn.Close()
			running = true
		}
	}
	start := time.Now()
	if c, err = testenv.StartRabbitCluster(brokerClusterBase, brokerClusterName); err != nil {
		return nil, nil, fmt.Errorf("start the RabbitMQ cluster: %w", err)
	}
	if running {
		logf("broker: the RabbitMQ cluster at %s was running: it stays up", strings.Join(c.URLs(1), " "))
		return c, func() {}, nil
	}
	logf("broker: RabbitMQ cluster started at %s in %s", strings.Join(c.URLs(1), " "), time.Since(start).Round(100*time.Millisecond))
	return c, func() {
		if err := c.Stop(); err != nil {
			logf("broker: stopping the RabbitMQ cluster: %v", err)
		} else {
			logf("broker: RabbitMQ cluster stopped")
		}
	}, nil
}

func (h *harness) brokerSection(ctx context.Context) (lines []*line, err error) {
	cfg := h.cfg
	db, err := h.newSchema(ctx, "broker")
	if err != nil {
		return nil, err
	}
	env, err := newRouterEnv(ctx, cfg, db)
	if err != nil {
		return nil, err
	}
	defer env.pool.Close()

	var setups, clusterSetups []*brokerSetup
	var cluster *testenv.RabbitCluster
	stopCluster := func() {}
	// At the end: this run's queues deleted from a cluster that stays up
	// (a stopped one loses its data anyway), the clients closed, then the
	// cluster stopped if this run started it.
	defer func() {
		for _, s := range clusterSetups {
			if s.ch == nil {
				continue
			}
			for _, q := range []string{s.relayQueue, s.routerQueue} {
				if _, err := s.ch.QueueDelete(q, false, false, false); err != nil {
					logf("broker: deleting queue %s: %v", q, err)
				}
			}
		}
		for _, s := range setups {
			s.close()
		}
		stopCluster()
	}()
	for _, key := range cfg.brokerSetups {
		s := &brokerSetup{key: key, pubURLs: []string{cfg.amqpURL}, subURLs: []string{cfg.amqpURL}}
		switch key {
		case "classic":
			s.name = "single node, classic queue"
		case "quorum":
			s.name, s.queues = "single node, quorum queue", rabbitmq.Queues{Type: rabbitmq.Quorum}
		case "cluster", "cluster-spread":
			s.queues, s.cluster = rabbitmq.Queues{Type: rabbitmq.Quorum}, true
			s.name = "3 nodes, quorum queue, clients on its leader"
			if key == "cluster-spread" {
				s.name = "3 nodes, quorum queue, clients on followers"
			}
			if cluster == nil {
				c, stop, err := brokerCluster()
				if err != nil {
					return nil, err
				}
				cluster, stopCluster = c, stop
			}
			clusterSetups = append(clusterSetups, s)
		}
		s.relayQueue = "benchtable_broker_" + strings.ReplaceAll(key, "-", "_") + "_relay_" + h.id
		s.routerQueue = "benchtable_broker_" + strings.ReplaceAll(key, "-", "_") + "_router_" + h.id
		declareURLs := []string{cfg.amqpURL}
		if s.cluster {
			declareURLs = cluster.URLs(1)
		} else {
			h.queues = append(h.queues, s.relayQueue, s.routerQueue) // deleted by cleanup
		}
		if err := s.queues.Declare(ctx, declareURLs, s.relayQueue, s.routerQueue); err != nil {
			return nil, fmt.Errorf("%s: %w", s.name, err)
		}
		setups = append(setups, s)
	}
	if cluster != nil {
		if err := placeClients(cluster, clusterSetups, h.id); err != nil {
			return nil, err
		}
	}
	for _, s := range setups {
		if s.conn, err = amqp.Dial(s.pubURLs[0]); err != nil {
			return nil, fmt.Errorf("%s: RabbitMQ at %s: %w", s.name, s.pubURLs[0], err)
		}
		if s.ch, err = s.conn.Channel(); err != nil {
			return nil, err
		}
		if s.pub, err = rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: s.pubURLs[0], URLs: s.pubURLs[1:], Queues: s.queues, Window: cfg.window}); err != nil {
			return nil, err
		}
	}

	var variants []brokerVariant
	for _, w := range cfg.brokerWorkers {
		variants = append(variants, brokerVariant{relayWorkers: w})
	}
	variants = append(variants, brokerVariant{mode: perMessage}, brokerVariant{mode: groupCommitExec})

	rates := map[brokerVariant]map[string][]float64{}
	for _, v := range variants {
		rates[v] = map[string][]float64{}
	}
	seq := 0 // outbox rows written so far: unique UUIDs across rounds
	for r := range cfg.rounds {
		var parts []string
		for i := range variants {
			v := variants[(i+r)%len(variants)]
			var out []string
			for j := range setups {
				s := setups[(j+r)%len(setups)]
				var rate float64
				if v.relayWorkers > 0 {
					rate, err = h.brokerRelayRound(ctx, env, s, v, seq)
					seq += cfg.brokerRows
				} else {
					rate, err = h.brokerRouterRound(ctx, env, s, v, r)
				}
				if err != nil {
					return nil, fmt.Errorf("round %d, %s, %s: %w", r+1, v, s.name, err)
				}
				rates[v][s.key] = append(rates[v][s.key], rate)
				out = append(out, fmt.Sprintf("%s %s", s.key, thousands(int64(rate))))
			}
			parts = append(parts, fmt.Sprintf("%s: %s", v, strings.Join(out, ", ")))
		}
		logf("broker round %d/%d (events/s, msg/s): %s", r+1, cfg.rounds, strings.Join(parts, "; "))
	}
	return brokerLines(cfg, setups, variants, rates), nil
}

// placeClients finds the leader of each cluster setup's queues and connects
// the setup's clients relative to it: all on the leader ("cluster"), or the
// publisher on the next node and the subscriber on the one after
// ("cluster-spread"); each client is given the other nodes after its own.
func placeClients(c *testenv.RabbitCluster, setups []*brokerSetup, id string) error {
	var infos []testenv.QueueInfo
	var err error
	// A new quorum queue's leader may take a moment to be reported.
	for range 20 {
		if infos, err = c.Queues("benchtable_broker_"); err != nil {
			return fmt.Errorf("list the cluster's queues: %w", err)
		}
		ok := true
		for _, s := range setups {
			ok = ok && leaderOf(c, infos, s.routerQueue) > 0 && leaderOf(c, infos, s.relayQueue) > 0
		}
		if ok {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	for _, s := range setups {
		lead := leaderOf(c, infos, s.routerQueue)
		if lead == 0 {
			return fmt.Errorf("%s: the cluster reports no leader for queue %s (run %s)", s.name, s.routerQueue, id)
		}
		if l := leaderOf(c, infos, s.relayQueue); l != lead {
			logf("broker: %s: queue %s is led by node %d, %s by node %d: the clients follow the latter's", s.name, s.relayQueue, l, s.routerQueue, lead)
		}
		next := func(k int) int { return (lead-1+k)%3 + 1 }
		pub, sub := lead, lead
		if s.key == "cluster-spread" {
			pub, sub = next(1), next(2)
		}
		s.pubURLs, s.subURLs = c.URLs(pub), c.URLs(sub)
		logf("broker: %s: queues led by node %d; relay publisher and pre-fill on node %d, subscriber on node %d", s.name, lead, pub, sub)
	}
	return nil
}

// leaderOf is the node leading queue q, 0 if none is reported.
func leaderOf(c *testenv.RabbitCluster, infos []testenv.QueueInfo, q string) int {
	for _, in := range infos {
		if in.Name == q {
			return c.LeaderNode(in)
		}
	}
	return 0
}

// brokerLines are the section's lines: per variant, each setup against the
// single node with classic queues.
func brokerLines(cfg *config, setups []*brokerSetup, variants []brokerVariant, rates map[brokerVariant]map[string][]float64) []*line {
	var base *brokerSetup
	for _, s := range setups {
		if s.key == "classic" {
			base = s
		}
	}
	var lines []*line
	for _, v := range variants {
		name, unit := "", "msg/s"
		switch {
		case v.relayWorkers > 0:
			name = fmt.Sprintf("broker: outbox relay, %d %s, BatchSize %d, window %d, %s rows", v.relayWorkers, plural(v.relayWorkers, "worker"), cfg.relayBatch, cfg.window, short(cfg.brokerRows))
			unit = "events/s"
		case v.mode == perMessage:
			name = fmt.Sprintf("broker: router, per-message, prefetch %d, %s msgs", cfg.prefetch, short(cfg.brokerMessages))
		default:
			name = fmt.Sprintf("broker: router, group commit + Exec, prefetch %d, %s msgs", cfg.batchPrefetch, short(cfg.brokerMessages))
		}
		for _, s := range setups {
			if s == base {
				continue
			}
			lines = append(lines, &line{name: name, aName: s.name, bName: base.name, a: rates[v][s.key], b: rates[v][base.key], unit: unit, target: "—"})
		}
	}
	return lines
}

// brokerRelayRound fills the outbox with cfg.brokerRows rows for s's relay
// queue (rows seq+1..), empties the queue, and times outbox.Relay draining
// them through s's publisher. It returns events/s.
func (h *harness) brokerRelayRound(ctx context.Context, env *routerEnv, s *brokerSetup, v brokerVariant, seq int) (float64, error) {
	cfg := h.cfg
	n := cfg.brokerRows
	if err := h.exec(ctx, mustSQL(postgres, "Truncate", sqlData{Table: env.db.Outbox()})); err != nil {
		return 0, err
	}
	if err := h.exec(ctx, mustSQL(postgres, "FillOutbox", sqlData{Outbox: env.db.Outbox()}), s.relayQueue, seq+1, seq+n); err != nil {
		return 0, fmt.Errorf("fill: %w", err)
	}
	if err := h.exec(ctx, mustSQL(postgres, "Analyze", sqlData{Table: env.db.Outbox()})); err != nil {
		return 0, err
	}
	if _, err := s.ch.QueuePurge(s.relayQueue, false); err != nil {
		return 0, err
	}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: env.db, Publisher: s.pub, Logger: watermill.NopLogger{},
		BatchSize: cfg.relayBatch, Workers: v.relayWorkers})
	if err != nil {
		return 0, err
	}
	var rows int
	var wall time.Duration
	err = h.timed(fmt.Sprintf("broker/%s/%s", v, s.key), func() (int, time.Duration, error) {
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		done := make(chan error, 1)
		start := time.Now()
		go func() { done <- relay.Run(rctx) }()
		rows, wall = until(ctx, start, n, cfg.relayTime, func() int { return int(relay.Stats().Relayed) })
		cancel()
		return rows, wall, <-done
	})
	if err != nil {
		return 0, err
	}
	if st := relay.Stats(); st.Failures > 0 {
		return 0, fmt.Errorf("relay: %d failed batches, last: %w", st.Failures, st.LastError)
	}
	if rows < n {
		logf("broker: %s, %s: %d of %d rows relayed within -relay-time %s", v, s.name, rows, n, cfg.relayTime)
	}
	// What was counted must be in the queue.
	st, err := s.ch.QueueDeclarePassive(s.relayQueue, true, false, false, false, nil)
	if err != nil {
		return 0, err
	}
	if st.Messages < rows {
		return 0, fmt.Errorf("relay: %d events counted, but queue %s holds %d", rows, s.relayQueue, st.Messages)
	}
	return float64(rows) / wall.Seconds(), nil
}

// brokerRouterRound pre-fills s's router queue with cfg.brokerMessages
// messages, times a fresh router draining them through rabbitmq.Subscriber
// (connected as s says) with the middleware in mode v.mode, and checks that
// each message has its business row and its inbox record. It returns msg/s.
func (h *harness) brokerRouterRound(ctx context.Context, env *routerEnv, s *brokerSetup, v brokerVariant, round int) (float64, error) {
	cfg := h.cfg
	n := cfg.brokerMessages
	for _, t := range []string{env.business, env.db.Inbox()} {
		if err := h.exec(ctx, mustSQL(postgres, "Truncate", sqlData{Table: t})); err != nil {
			return 0, err
		}
	}
	if _, err := s.ch.QueuePurge(s.routerQueue, false); err != nil {
		return 0, err
	}
	prefix := fmt.Sprintf("b%d-%s-%s-", round, s.key, sanitize(v.String()))
	if err := publishParallel(ctx, s.conn, s.routerQueue, prefix, 0, n); err != nil {
		return 0, fmt.Errorf("pre-fill: %w", err)
	}
	st, err := s.ch.QueueDeclarePassive(s.routerQueue, true, false, false, false, nil)
	if err != nil {
		return 0, err
	}
	if st.Messages != n {
		return 0, fmt.Errorf("pre-filled queue holds %d messages, want %d", st.Messages, n)
	}
	handler, err := env.handler(v.mode)
	if err != nil {
		return 0, err
	}
	prefetch := cfg.prefetch
	if v.mode == groupCommit || v.mode == groupCommitExec {
		prefetch = cfg.batchPrefetch
	}
	d := newDrain(n)
	err = h.timed(fmt.Sprintf("broker/%s/%s", v, s.key), func() (int, time.Duration, error) {
		sub, err := rabbitmq.NewSubscriber(rabbitmq.SubscriberConfig{URL: s.subURLs[0], URLs: s.subURLs[1:], Queues: s.queues,
			Prefetch: prefetch, Logger: watermill.NopLogger{}})
		if err != nil {
			return 0, 0, err
		}
		err = runRouterOn(ctx, sub, s.routerQueue, d, handler, 10*time.Minute)
		return n, d.end.Sub(d.start), err
	})
	if err != nil {
		return 0, err
	}
	if bad := d.bad.Load(); bad > 0 {
		logf("broker %s, %s: %d handler errors (redelivered), last: %v", v, s.name, bad, d.lastErr.Load())
	}
	rows, err := h.count(ctx, mustSQL(postgres, "Count", sqlData{Table: env.business}))
	if err != nil {
		return 0, err
	}
	inbox, err := h.count(ctx, mustSQL(postgres, "Count", sqlData{Table: env.db.Inbox()}))
	if err != nil {
		return 0, err
	}
	if rows != int64(n) || inbox != int64(n) {
		return 0, fmt.Errorf("%d business rows and %d inbox records, want %d each", rows, inbox, n)
	}
	return float64(n) / d.end.Sub(d.start).Seconds(), nil
}

// brokerSummary is the section's settings, for the header.
func brokerSummary(cfg *config) string {
	var w []string
	for _, n := range cfg.brokerWorkers {
		w = append(w, strconv.Itoa(n))
	}
	return fmt.Sprintf("broker: setups %s; relay %d rows per round, Workers %s, BatchSize %d, window %d; router %d msgs per round, per-message prefetch %d, group commit + Exec prefetch %d",
		strings.Join(cfg.brokerSetups, ","), cfg.brokerRows, strings.Join(w, ","), cfg.relayBatch, cfg.window, cfg.brokerMessages, cfg.prefetch, cfg.batchPrefetch)
}
