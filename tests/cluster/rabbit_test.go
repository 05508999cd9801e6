package cluster_test

// The rabbitmq package on the three-node cluster with quorum queues: node
// crashes, leader moves, the client's node going, a lost majority. Each
// test leaves the three nodes running.

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
)

// Two Publishers, one connected to the queue's leader's node and one to
// another, publish batches to a quorum queue while the leader's node is
// killed: every message reported confirmed is in the queue, no failure is
// permanent, and publishing the failed ones again gets every message in
// (some twice: a failed message's outcome is unknown).
func TestQuorumPublisherConfirmsWhenTheLeaderDies(t *testing.T) {
	ctx := testCtx(t, 3*time.Minute)
	nodes := clusterNodes(t)
	q := clusterQueue(t, "confirms")
	require.NoError(t, quorum.Declare(ctx, rabbit.URLs(1), q))
	leader := leaderOf(t, q)
	other := otherThan(leader)

	type stream struct {
		name           string
		pub            *rabbitmq.Publisher
		sent           int
		confirmed      []string
		failed         []*message.Message
		errs           []error
		afterKill      int // batches published after the kill
		confirmedLater int // confirmed in those batches
		permanent      int
	}
	streams := []*stream{
		{name: "on-leader", pub: newPublisher(t, rabbitmq.PublisherConfig{URLs: rabbit.URLs(leader), Queues: quorum})},
		{name: "on-other", pub: newPublisher(t, rabbitmq.PublisherConfig{URLs: rabbit.URLs(other), Queues: quorum})},
	}
	const batch = 100
	var confirmed atomic.Int64
	var killed atomic.Bool
	killedAt := time.Now() // set again before killed
	var wg sync.WaitGroup
	for _, s := range streams {
		wg.Go(func() {
			// Batches until 500 messages were confirmed after the kill,
			// and 1500 messages; after a failure, a pause as a relay's.
			for s.confirmedLater < 500 || s.sent < 1500 {
				after := killed.Load()
				failedBefore := len(s.errs)
				msgs := newMessages(s.name, s.sent, batch)
				s.sent += batch
				for i, err := range s.pub.PublishBatch(ctx, toTopic(q, msgs)) {
					if err == nil {
						s.confirmed = append(s.confirmed, msgs[i].UUID)
						confirmed.Add(1)
						if after {
							s.confirmedLater++
						}
						continue
					}
					s.failed = append(s.failed, msgs[i])
					s.errs = append(s.errs, err)
					if exactlyonce.IsPermanent(err) {
						s.permanent++
					}
				}
				if after {
					s.afterKill++
				}
				if ctx.Err() != nil {
					return
				}
				if n := len(s.errs); n > failedBefore {
					if after {
						t.Logf("%s: %s after the kill: %d failed: %v", s.name, time.Since(killedAt).Round(time.Millisecond), n-failedBefore, s.errs[n-1])
					}
					time.Sleep(100 * time.Millisecond)
				}
			}
		})
	}
	testenv.Eventually(t, time.Minute, func() bool { return confirmed.Load() >= 600 }, "the publishers got going")
	killedAt = time.Now()
	nodes.kill(leader)
	killed.Store(true)
	wg.Wait()
	streamed := time.Since(killedAt)
	restart := nodes.start(leader)
	newLeader := leaderOf(t, q)

	for _, s := range streams {
		t.Logf("%s: %d messages, %d confirmed, %d failed (%d permanent), %d confirmed in the %d batches after the kill; errors:\n\t%s",
			s.name, s.sent, len(s.confirmed), len(s.failed), s.permanent, s.confirmedLater, s.afterKill, errorKinds(s.errs))
		require.Zero(t, s.permanent, "%s: a failure for a node's death is never the message's own", s.name)
		require.Positive(t, s.confirmedLater, "%s: publishing went on after the kill", s.name)
	}
	got := drain(t, q, other)
	for _, s := range streams {
		for _, u := range s.confirmed {
			require.Positive(t, got[u], "%s: message %s was confirmed and is not in the queue", s.name, u)
		}
	}
	// The failed ones again, until each is confirmed.
	retried := 0
	for _, s := range streams {
		todo := s.failed
		for round := 0; len(todo) > 0; round++ {
			require.Less(t, round, 5, "%s: %d messages still fail", s.name, len(todo))
			var again []*message.Message
			for i, err := range s.pub.PublishBatch(ctx, toTopic(q, todo)) {
				retried++
				if err != nil {
					require.False(t, exactlyonce.IsPermanent(err))
					again = append(again, todo[i])
				}
			}
			todo = again
		}
	}
	for u, n := range drain(t, q, other) {
		got[u] += n
	}
	dups := 0
	for _, s := range streams {
		for _, m := range newMessages(s.name, 0, s.sent) {
			require.Positive(t, got[m.UUID], "%s: message %s never arrived", s.name, m.UUID)
			dups += got[m.UUID] - 1
			delete(got, m.UUID)
		}
	}
	require.Empty(t, got, "messages nobody published")
	t.Logf("leader node %d killed, publishing went on %s; restarted in %s, leader then node %d; %d republished, %d duplicates in the queue",
		leader, streamed.Round(time.Millisecond), restart.Round(time.Millisecond), newLeader, retried, dups)
}

// A Subscriber connected to node X consumes a quorum queue while (a) the
// queue's leader (another node) is killed and (b) node X itself is killed:
// it goes on by itself (through another node in (b)), every message is
// delivered, and only messages in flight at a kill come again.
func TestQuorumSubscriberWhenTheLeaderAndItsNodeDie(t *testing.T) {
	ctx := testCtx(t, 3*time.Minute)
	nodes := clusterNodes(t)
	q := clusterQueue(t, "consume")
	require.NoError(t, quorum.Declare(ctx, rabbit.URLs(1), q))
	leader := leaderOf(t, q)
	x := otherThan(leader)
	z := otherThan(leader, x)
	pub := newPublisher(t, rabbitmq.PublisherConfig{URLs: rabbit.URLs(z), Queues: quorum})
	const prefetch = 16
	sub := newSubscriber(t, rabbitmq.SubscriberConfig{URLs: rabbit.URLs(x), Queues: quorum, Prefetch: prefetch})
	msgs, err := sub.Subscribe(ctx, q)
	require.NoError(t, err)
	c := newCounter()
	consume(msgs, c, 20*time.Millisecond)

	phase := func(name string, kill int) {
		const n = 1000
		all := newMessages(name, 0, n)
		var uuids []string
		for _, m := range all {
			uuids = append(uuids, m.UUID)
		}
		base := c.distinct()
		publishAll(t, ctx, pub, toTopic(q, all))
		testenv.Eventually(t, time.Minute, func() bool { return c.distinct() >= base+n/4 }, "%s: consuming", name)
		atKill, repeatsBefore := c.distinct()-base, c.repeats()
		killedAt := time.Now()
		nodes.kill(kill)
		testenv.Eventually(t, 2*time.Minute, func() bool { return c.has(uuids) }, "%s: every message delivered after node %d died", name, kill)
		done := time.Since(killedAt)
		require.Less(t, atKill, n, "%s: the kill came before the last delivery", name)
		t.Logf("%s: node %d killed after %d of %d deliveries: the stream stopped for at most %s, every message delivered %s after the kill, %d redelivered",
			name, kill, atKill, n, c.gapAfter(killedAt).Round(time.Millisecond), done.Round(time.Millisecond), c.repeats()-repeatsBefore)
		restart := nodes.start(kill)
		t.Logf("%s: node %d restarted in %s", name, kill, restart.Round(time.Millisecond))
	}
	phase("leader", leader)
	t.Logf("the leader is now node %d; the subscriber's node is %d", leaderOf(t, q), x)
	phase("own-node", x)
	require.LessOrEqual(t, c.repeats(), 2*prefetch, "only the deliveries in flight at a kill (at most the prefetch) come again")
}

// The lost majority: two of the three nodes killed for 10 s while rows
// are written, an outbox relay (rabbitmq.Publisher, quorum queue, a short
// ConfirmTimeout, MaxAttempts 3) and a Subscriber connected to node 1:
//   - pause_minority (scripts/rabbit-cluster.sh), node 1 among the dead:
//     the survivor pauses (closes every connection, refuses new ones);
//   - ignore (RabbitMQ's default) on node 1, which survives: it keeps its
//     connections and takes publishes without confirming them, and does
//     not answer the declaration of a new quorum queue (a Publisher's
//     first message to it fails after ConfirmTimeout instead of hanging).
//
// Either way nothing is quarantined, the relay and the Subscriber resume
// by themselves when the nodes return, and every row is consumed.
func TestQuorumMajorityLost(t *testing.T) {
	t.Run("pause_minority, the client's node dies", func(t *testing.T) { majorityLost(t, "pause_minority", []int{1, 2}) })
	t.Run("ignore, the client's node survives", func(t *testing.T) { majorityLost(t, "ignore", []int{2, 3}) })
}

func majorityLost(t *testing.T, handling string, kill []int) {
	const client = 1
	ctx := testCtx(t, 3*time.Minute)
	nodes := clusterNodes(t)
	db := testenv.Schema(t)
	q := clusterQueue(t, "outage")
	fresh := []string{clusterQueue(t, "fresh_a"), clusterQueue(t, "fresh_b")}
	require.NoError(t, quorum.Declare(ctx, rabbit.URLs(client), q))
	cfg := rabbitmq.PublisherConfig{URLs: rabbit.URLs(client), Queues: quorum, ConfirmTimeout: 3 * time.Second}
	pub := &recorder{Publisher: newPublisher(t, cfg)}
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		DB: db, Publisher: pub, Logger: testenv.Logger(t), BatchSize: 50, MaxAttempts: 3,
		PollInterval: 50 * time.Millisecond, ErrorBackoff: 100 * time.Millisecond, MaxErrorBackoff: time.Second,
	})
	require.NoError(t, err)
	runRelay(t, relay)
	sub := newSubscriber(t, rabbitmq.SubscriberConfig{URLs: rabbit.URLs(client), Queues: quorum, Prefetch: 32, ReconnectDelay: time.Second})
	msgs, err := sub.Subscribe(ctx, q)
	require.NoError(t, err)
	c := newCounter()
	consume(msgs, c, 0)
	// A second Subscriber, on its own queue, connected first to a node
	// that dies: it consumes again through the survivor (ignore: a node
	// without a majority) or waits for a node (pause_minority).
	q2 := clusterQueue(t, "outage2")
	sub2 := newSubscriber(t, rabbitmq.SubscriberConfig{URLs: rabbit.URLs(kill[0]), Queues: quorum, Prefetch: 32, ReconnectDelay: time.Second})
	msgs2, err := sub2.Subscribe(ctx, q2)
	require.NoError(t, err)
	c2 := newCounter()
	consume(msgs2, c2, 0)

	before := writeRows(t, ctx, db, "before", 100, q)
	before2 := writeRows(t, ctx, db, "before2", 20, q2)
	testenv.Eventually(t, time.Minute, func() bool { return c.has(before) && c2.has(before2) }, "relayed and consumed before the outage")
	if handling != "pause_minority" {
		setPartitionHandling(t, client, handling)
		t.Cleanup(func() { setPartitionHandling(t, client, "pause_minority") })
	}
	pub.record()
	killedAt := time.Now()
	nodes.kill(kill...)
	during := writeRows(t, ctx, db, "during", 100, q)
	during2 := writeRows(t, ctx, db, "during2", 20, q2)

	// A first message to a new quorum queue: no node answers
	// (pause_minority), or its declaration has no answer (ignore: the
	// broker fails it, closing the connection, only when its own timeout
	// ends). Either way the call returns when its context ends (a) or
	// after ConfirmTimeout (b), the failure not permanent.
	for i, c := range []struct {
		name    string
		timeout time.Duration
		want    error
		text    string
	}{{"(a) a call whose context ends", time.Second, context.DeadlineExceeded, ""}, {"(b) a call", time.Minute, nil, "no answer within 3s"}} {
		res := make(chan []error, 1)
		t0 := time.Now()
		go func() {
			cctx, cancel := context.WithTimeout(ctx, c.timeout)
			defer cancel()
			res <- newPublisher(t, cfg).PublishBatch(cctx, toTopic(fresh[i], newMessages("fresh", 0, 1)))
		}()
		select {
		case errs := <-res:
			require.Error(t, errs[0])
			require.False(t, exactlyonce.IsPermanent(errs[0]))
			if handling == "ignore" {
				if c.want != nil {
					require.ErrorIs(t, errs[0], c.want, c.name)
				} else {
					require.ErrorContains(t, errs[0], c.text, c.name)
				}
			}
			t.Logf("%s to a new quorum queue during the outage returned after %s: %v", c.name, time.Since(t0).Round(time.Millisecond), errs[0])
		case <-time.After(2 * time.Minute):
			t.Fatalf("%s: PublishBatch to a new quorum queue did not return during the outage", c.name)
		}
	}

	time.Sleep(time.Until(killedAt.Add(10 * time.Second))) // the outage
	p, st := pending(t, db), relay.Stats()
	calls, errs := pub.record()
	t.Logf("after 10 s without a majority: %d rows pending (%d failing, %d quarantined), relay: %d relayed, %d failed batches; %d of the rows written during the outage consumed; %d calls, errors:\n\t%s",
		p.Count, p.Failing, p.Quarantined, st.Relayed, st.Failures, c.distinct()-len(before), calls, errorKinds(errs))
	require.Zero(t, p.Quarantined, "nothing quarantined during the outage")
	restart := nodes.start(kill...)
	back := time.Now()
	testenv.Eventually(t, 2*time.Minute, func() bool { return c.has(during) }, "every row written during the outage consumed")
	testenv.Eventually(t, time.Minute, func() bool { return c2.has(during2) }, "the second Subscriber consumes again")
	resumed := time.Since(back)
	testenv.Eventually(t, 30*time.Second, func() bool { return pending(t, db).Count == 0 }, "the outbox is emptied")
	p, st = pending(t, db), relay.Stats()
	calls, errs = pub.record()
	require.Zero(t, p.Quarantined)
	require.Zero(t, st.Quarantined)
	// A queue whose declaration was attempted during the outage: its
	// messages never fail as permanent once the majority is back (the
	// outbox keeps them). Whether such a queue serves again is RabbitMQ's:
	// one declared on a node just as it lost the majority stayed without
	// confirms for a minute in one run of ours (docs/clusters.md), so it is
	// logged, not asserted.
	for _, q := range fresh {
		pub := newPublisher(t, cfg)
		deadline := time.Now().Add(30 * time.Second)
		for {
			errs := pub.PublishBatch(ctx, toTopic(q, newMessages("fresh", 0, 1)))
			for _, err := range errs {
				require.False(t, exactlyonce.IsPermanent(err), "a queue declared during the outage: a failure marked permanent: %v", err)
			}
			if errs[0] == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Logf("queue %s, declared during the outage, confirms nothing 30 s after the majority is back: %v", q, errs[0])
				break
			}
		}
	}
	t.Logf("second Subscriber (first URL: node %d) consumed every row by %s after the restart, %d repeated deliveries", kill[0], time.Since(back).Round(time.Millisecond), c2.repeats())
	t.Logf("nodes %v killed for %s, restarted in %s; every row consumed %s after the restart; relay: %d relayed, %d failed batches; %d repeated deliveries; since the restart began, %d calls, errors:\n\t%s",
		kill, back.Sub(killedAt).Round(time.Millisecond), restart.Round(time.Millisecond), resumed.Round(time.Millisecond), st.Relayed, st.Failures, c.repeats(), calls, errorKinds(errs))
}

// A partitioned topic on quorum queues with single active consumer, two
// instances connected to different nodes: killed the node of the active
// instance (with the leaders of the partitions it has), then the other
// instance's node: each key's messages are handled in publish order (a
// message comes again only right after itself, never after a later one),
// and none is lost.
func TestQuorumPartitionsKeepEachKeysOrder(t *testing.T) {
	ctx := testCtx(t, 3*time.Minute)
	nodes := clusterNodes(t)
	topic := testenv.Unique(t, "eo_cl_parts_")
	const n = 4
	var names []string
	for i := range n {
		names = append(names, rabbitmq.PartitionQueue(topic, i))
	}
	t.Cleanup(func() { deleteQueues(t, names...) })
	// Partition i declared through node i%3+1, where its leader starts.
	for i, name := range names {
		conn, err := dialNode(rabbit.URL(i%3 + 1))
		require.NoError(t, err)
		ch, err := conn.Channel()
		require.NoError(t, err)
		_, err = ch.QueueDeclare(name, true, false, false, false, quorum.PartitionArguments())
		require.NoError(t, err)
		_ = conn.Close()
	}
	leaders := map[int][]int{}
	for i, name := range names {
		l := leaderOf(t, name)
		leaders[l] = append(leaders[l], i)
	}
	t.Logf("partition leaders: %v", leaders)

	pub := newPublisher(t, rabbitmq.PublisherConfig{URLs: rabbit.URLs(3), Queues: quorum, Partitions: map[string]int{topic: n}})
	type seen struct {
		instance string
		seq      int
	}
	var mu sync.Mutex
	byKey := map[string][]seen{}
	c := newCounter()
	for _, inst := range []struct {
		name string
		node int
	}{{"A", 1}, {"B", 2}} {
		ps := rabbitmq.PartitionedSubscriber(newSubscriber(t, rabbitmq.SubscriberConfig{URLs: rabbit.URLs(inst.node), Queues: quorum}), n)
		msgs, err := ps.Subscribe(ctx, topic)
		require.NoError(t, err)
		go func() {
			for m := range msgs {
				var seq int
				_, _ = fmt.Sscanf(string(m.Payload), `{"seq":%d}`, &seq)
				mu.Lock()
				key := msgid.OrderingKey(m)
				byKey[key] = append(byKey[key], seen{inst.name, seq})
				mu.Unlock()
				c.add(m.UUID)
				go func() {
					time.Sleep(10 * time.Millisecond)
					m.Ack()
				}()
			}
		}()
	}

	const keys, perPhase = 20, 30
	phase := func(name string, from int, kill int) {
		var batch []msgid.TopicMessage
		var uuids []string
		for s := from; s < from+perPhase; s++ {
			for k := range keys {
				m := message.NewMessage(fmt.Sprintf("k%02d-%03d", k, s), []byte(fmt.Sprintf(`{"seq":%d}`, s)))
				msgid.SetOrderingKey(m, fmt.Sprintf("k%02d", k))
				batch = append(batch, msgid.TopicMessage{Topic: topic, Message: m})
				uuids = append(uuids, m.UUID)
			}
		}
		base := c.distinct()
		publishAll(t, ctx, pub, batch)
		testenv.Eventually(t, time.Minute, func() bool { return c.distinct() >= base+len(batch)/4 }, "%s: consuming", name)
		atKill, repeatsBefore := c.distinct()-base, c.repeats()
		killedAt := time.Now()
		nodes.kill(kill)
		testenv.Eventually(t, 2*time.Minute, func() bool { return c.has(uuids) }, "%s: every message handled after node %d died", name, kill)
		require.Less(t, atKill, len(batch), "%s: the kill came before the last delivery", name)
		t.Logf("%s: node %d killed after %d of %d messages: the stream stopped for at most %s, %d redelivered",
			name, kill, atKill, len(batch), c.gapAfter(killedAt).Round(time.Millisecond), c.repeats()-repeatsBefore)
		nodes.start(kill)
	}
	phase("active instance's node", 0, 1)
	phase("other instance's node", perPhase, 2)

	mu.Lock()
	defer mu.Unlock()
	switches := 0
	for k := range keys {
		key := fmt.Sprintf("k%02d", k)
		got := byKey[key]
		prev := seen{seq: -1}
		for i, s := range got {
			require.True(t, s.seq == prev.seq || s.seq == prev.seq+1,
				"key %s: message %d handled after %d (handling %d of %v)", key, s.seq, prev.seq, i, got)
			if i > 0 && s.instance != prev.instance {
				switches++
			}
			prev = s
		}
		require.Equal(t, 2*perPhase-1, prev.seq, "key %s: the last message handled", key)
	}
	t.Logf("%d keys x %d messages in order; %d handovers between instances (over the keys); %d redelivered", keys, 2*perPhase, switches, c.repeats())
}

// The broker's delivery limit and at-least-once dead-lettering on the
// cluster: messages nacked by the consumer over Queues.DeliveryLimit go to
// the dead-letter queue, even with the queue's leader killed while they
// go round; none is dropped, none stays behind.
func TestQuorumDeliveryLimitDeadLettersWhenTheLeaderDies(t *testing.T) {
	ctx := testCtx(t, 4*time.Minute)
	nodes := clusterNodes(t)
	q, dlq := clusterQueue(t, "limited"), clusterQueue(t, "dlq")
	require.NoError(t, quorum.Declare(ctx, rabbit.URLs(1), dlq))
	const limit = 2
	queues := rabbitmq.Queues{Type: rabbitmq.Quorum, DeliveryLimit: limit, DeadLetterRoutingKey: dlq}
	require.NoError(t, queues.Declare(ctx, rabbit.URLs(1), q))
	leader := leaderOf(t, q)
	x := otherThan(leader)
	const n = 200
	all := newMessages("limited", 0, n)
	publishAll(t, ctx, newPublisher(t, rabbitmq.PublisherConfig{URLs: rabbit.URLs(x), Queues: queues}), toTopic(q, all))

	sub := newSubscriber(t, rabbitmq.SubscriberConfig{URLs: rabbit.URLs(x), Queues: queues, Prefetch: 4})
	msgs, err := sub.Subscribe(ctx, q)
	require.NoError(t, err)
	c := newCounter()
	go func() {
		for m := range msgs {
			c.add(m.UUID)
			go func() {
				time.Sleep(20 * time.Millisecond)
				m.Nack()
			}()
		}
	}()
	testenv.Eventually(t, time.Minute, func() bool { return c.distinct() >= n/3 }, "consuming")
	killedAt := time.Now()
	nodes.kill(leader)
	var dead map[string]int
	testenv.Eventually(t, time.Minute, func() bool {
		qs, err := rabbit.Queues(q, x)
		return err == nil && len(qs) == 1 && qs[0].Messages == 0 && c.distinct() == n
	}, "every message dead-lettered: none left in the queue")
	after := c.since(killedAt)
	require.Positive(t, after, "deliveries after the kill")
	// Dead-lettering at least once: the leader hands a message over to the
	// DLQ and keeps it until the DLQ confirmed it (a new leader takes over
	// what was pending). With the leader killed mid-way, RabbitMQ 3.10 did
	// not always bring every message there: in two of about eight runs
	// some never arrived (docs/clusters.md). So the count is measured and
	// logged, not asserted; what is asserted: the queue emptied, every
	// message reached the consumer, and dead-lettering went on after the
	// kill.
	nodes.start(leader)
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		qs, err := rabbit.Queues(dlq, x)
		if err == nil && len(qs) == 1 && qs[0].Messages >= n {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	dead = drain(t, dlq, x)
	require.NotEmpty(t, dead, "nothing dead-lettered")
	most, twice, missing := 0, 0, 0
	c.mu.Lock()
	for _, k := range c.count {
		most = max(most, k)
	}
	c.mu.Unlock()
	for _, m := range all {
		switch {
		case dead[m.UUID] == 0:
			missing++
		case dead[m.UUID] > 1:
			twice++
		}
	}
	t.Logf("%d of %d messages over the limit never reached the dead-letter queue within a minute of the killed leader's return", missing, n)
	t.Logf("leader node %d killed mid-way (%d deliveries after the kill); %d messages dead-lettered (%d twice), each delivered at most %d times (limit %d: %d deliveries expected)",
		leader, after, len(dead), twice, most, limit, limit+1)
}
