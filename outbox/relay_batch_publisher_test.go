package outbox_test

// The relay with a BatchPublisher: one call per batch, the same bookkeeping
// per message, each failure counted against its row only when the publisher
// marked it permanent.

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// publisherAs turns a test publisher into the one a scenario's relay uses.
type publisherAs func(message.Publisher) message.Publisher

// asIs is the publisher itself: the relay calls Publish per run of a topic.
func asIs(p message.Publisher) message.Publisher { return p }

// asBatch wraps the publisher as a BatchPublisher that publishes each message
// of a PublishBatch call on its own, in order: the same broker, reached
// through one call per batch.
func asBatch(p message.Publisher) message.Publisher { return oneByOne{p} }

type oneByOne struct{ message.Publisher }

var _ outbox.BatchPublisher = oneByOne{}

func (o oneByOne) PublishBatch(_ context.Context, batch []msgid.TopicMessage) []error {
	errs := make([]error, len(batch))
	for i, tm := range batch {
		errs[i] = o.Publisher.Publish(tm.Topic, tm.Message)
	}
	return errs
}

func (oneByOne) Publish(string, ...*message.Message) error {
	return errors.New("oneByOne: the relay must call PublishBatch, not Publish")
}

// The scenarios of the sequential publisher's failure tests, through a
// BatchPublisher: the same rows are quarantined and relayed.
func TestRelayBatchPublisherScenarios(t *testing.T) {
	t.Parallel()
	for name, scenario := range map[string]func(publisherAs) func(*testing.T, bundle){
		"PoisonRowFirstBatchSizeOne":             relayPoisonRowFirstBatchSizeOne,
		"BatchOfOnlyBadRows":                     relayBatchOfOnlyBadRows,
		"OutageOnsetsQuarantineNoHealthyRow":     relayOutageOnsetsQuarantineNoHealthyRow,
		"FlappingBrokerQuarantinesOnlyThePoison": relayFlappingBrokerQuarantinesOnlyThePoisonRow,
		"RetriesBehindFailingPairAreTried":       relayRetriesBehindFailingPairAreTried,
		"OutageAfterBriefRecovery":               relayOutageAfterBriefRecoveryQuarantinesNothing,
		"WorkersAndInstances":                    relayWorkersAndInstancesQuarantineOnlyThePoison,
		"PublisherFailure":                       relayPublisherFailure,
		"RunRetriesFailures":                     relayRunRetriesFailures,
		"QuarantinesUnpublishableRow":            relayQuarantinesUnpublishableRow,
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			eachEngine(t, scenario(asBatch))
		})
	}
}

// confirmBroker is a BatchPublisher whose confirms the test scripts call by
// call: each step gives the outcome of the i-th message of a call (nil:
// confirmed); once the steps are used up every message is confirmed. A
// message with badHeader is refused whatever the step says (a message the
// broker can never take). It records every call and counts the confirmed
// messages by topic/uuid.
type confirmBroker struct {
	mu       sync.Mutex
	steps    []func(ctx context.Context, i int) error
	calls    [][]string // topic/uuid of each call's messages, in order
	accepted map[string]int
	got      []delivered // confirmed messages, in order
	publish  int         // Publish calls: the relay must not make any
}

func newConfirmBroker() *confirmBroker { return &confirmBroker{accepted: map[string]int{}} }

var _ outbox.BatchPublisher = (*confirmBroker)(nil)

// script appends steps, one per coming call.
func (c *confirmBroker) script(steps ...func(ctx context.Context, i int) error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.steps = append(c.steps, steps...)
}

// unscript drops the steps no call used.
func (c *confirmBroker) unscript() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.steps = nil
}

// upTo confirms the first k messages of a call and fails the others, as an
// outage beginning after k messages does.
func upTo(k int) func(context.Context, int) error {
	return func(_ context.Context, i int) error {
		if i < k {
			return nil
		}
		return errBrokerDown
	}
}

// cancelAfter confirms the first k messages of a call, then cancels the
// relay's context (SIGTERM while confirms are outstanding): the rest fail
// with the context's error, as a publisher returns them.
func cancelAfter(k int, cancel context.CancelFunc) func(context.Context, int) error {
	return func(ctx context.Context, i int) error {
		if i < k {
			return nil
		}
		cancel()
		return ctx.Err()
	}
}

func (c *confirmBroker) PublishBatch(ctx context.Context, batch []msgid.TopicMessage) []error {
	c.mu.Lock()
	defer c.mu.Unlock()
	step := func(context.Context, int) error { return nil }
	if len(c.steps) > 0 {
		step, c.steps = c.steps[0], c.steps[1:]
	}
	errs := make([]error, len(batch))
	var call []string
	for i, tm := range batch {
		m := tm.Message
		key := tm.Topic + "/" + m.UUID
		call = append(call, key)
		if m.Metadata.Get(badHeader) != "" {
			errs[i] = exactlyonce.Permanent(fmt.Errorf("message %s refused: %w", m.UUID, errUnpublishable))
			continue
		}
		if errs[i] = step(ctx, i); errs[i] == nil {
			c.accepted[key]++
			c.got = append(c.got, delivered{Topic: tm.Topic, UUID: m.UUID, Payload: string(m.Payload), Metadata: maps.Clone(m.Metadata)})
		}
	}
	c.calls = append(c.calls, call)
	return errs
}

func (c *confirmBroker) Publish(string, ...*message.Message) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.publish++
	return errors.New("confirmBroker: the relay must call PublishBatch")
}

func (c *confirmBroker) Close() error { return nil }

func (c *confirmBroker) lastCall() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls[len(c.calls)-1]
}

func (c *confirmBroker) callCount() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.calls)
}

// requireConfirmedOnce requires that every key in want was confirmed once,
// and nothing else.
func (c *confirmBroker) requireConfirmedOnce(t *testing.T, want []string) {
	t.Helper()
	c.mu.Lock()
	got := maps.Clone(c.accepted)
	c.mu.Unlock()
	for _, k := range want {
		require.Equal(t, 1, got[k], "row %s confirmed %d times", k, got[k])
		delete(got, k)
	}
	require.Empty(t, got, "confirmed messages that are not expected rows")
}

// rowFailures returns attempts (permanent failures) and failures of the row
// with uuid (of any topic; the tests keep uuids unique).
func (b bundle) rowFailures(t testing.TB, uuid string) (attempts, failures int) {
	t.Helper()
	require.NoError(t, seam.QueryRow(b.ctx, b.db, "SELECT attempts, failures FROM "+b.tables.Outbox()+b.sql(" WHERE uuid = $1", " WHERE uuid = ?"), []any{uuid}, &attempts, &failures))
	return attempts, failures
}

func poisonMessage(uuid string) *message.Message {
	m := message.NewMessage(uuid, []byte("{}"))
	m.Metadata.Set(badHeader, "1")
	return m
}

// Every batch is one PublishBatch call with its rows in id order (topics
// interleaved), every message arrives once with its topic, UUID, payload and
// metadata, and Publish is never called.
func TestRelayBatchPublisherAllConfirmed(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		want := mixedMessages(250)
		b.publishAll(t, want)
		br := newConfirmBroker()
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: br, Logger: testenv.Logger(t), BatchSize: 40})
		require.NoError(t, err)

		var sizes []int
		for {
			n, err := relay.Flush(b.ctx)
			require.NoError(t, err)
			if n == 0 {
				break
			}
			sizes = append(sizes, n)
			require.Len(t, br.lastCall(), n, "one call per batch")
			require.Less(t, len(sizes), 100, "Flush does not converge")
		}
		require.Equal(t, []int{40, 40, 40, 40, 40, 40, 10}, sizes)
		require.Equal(t, 7, br.callCount(), "an empty poll makes no call")
		require.Zero(t, br.publish, "Publish is not used")
		require.Equal(t, want, br.got, "every message once, in id order, with its topic, payload and metadata")
		require.Zero(t, b.pending(t, b.db))
		require.Equal(t, outbox.RelayStats{Relayed: 250, Batches: 7}, relay.Stats())

		// A row that failed before comes first in the call, as in the
		// sequential publish.
		rows := b.goodRows(t, "t", "r", 0, 3)
		b.exec(t, "UPDATE "+b.tables.Outbox()+" SET failures = 1, last_error = 'test' WHERE uuid = 'r-00002'")
		n, err := relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Equal(t, 3, n)
		require.Equal(t, []string{rows[2], rows[0], rows[1]}, br.lastCall())
	})
}

// A poison message (the broker refuses it, with an error marked permanent)
// among good ones in one call: the good ones are confirmed and deleted, and
// each of its failures counts against it, wherever it sits in the call
// (first, in the middle, last): quarantined after exactly MaxAttempts
// failures, the rows around it relayed meanwhile.
func TestRelayBatchPublisherPoisonAmongGoodOnes(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		br := newConfirmBroker()
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: br, Logger: testenv.Logger(t), MaxAttempts: 3, BatchSize: 10,
			ErrorBackoff: time.Microsecond, MaxErrorBackoff: time.Microsecond, // due again at once
		})
		require.NoError(t, err)

		b.publish(t, "t", poisonMessage("head"))
		good := b.goodRows(t, "t", "g", 0, 2)
		b.publish(t, "t", poisonMessage("mid"))
		good = append(good, b.goodRows(t, "t", "g", 2, 2)...)
		b.publish(t, "t", poisonMessage("last"))
		for i := range 3 {
			n, err := relay.Flush(b.ctx)
			require.ErrorIs(t, err, errUnpublishable)
			require.Equal(t, []int{4, 1, 1}[i], n, "batch %d", i)
			for _, uuid := range []string{"head", "mid", "last"} {
				attempts, failures := b.rowFailures(t, uuid)
				require.Equal(t, i+1, failures, "batch %d: %s", i, uuid)
				require.Equal(t, i+1, attempts, "batch %d: %s: every failure is its own", i, uuid)
			}
			if i > 0 {
				require.Equal(t, []string{"t/head", "t/mid", "t/last"}, br.lastCall()[:3], "batch %d: the retried rows come first", i)
			}
			if i < 2 {
				require.Empty(t, b.quarantined(t), "batch %d", i)
				good = append(good, b.goodRows(t, "t", "g", 4+i, 1)...)
			}
		}
		require.Equal(t, []string{"t/head", "t/mid", "t/last"}, b.quarantined(t), "quarantined after MaxAttempts failures")
		require.Equal(t, int64(3), relay.Stats().Quarantined)
		br.requireConfirmedOnce(t, good)
	})
}

// An outage beginning mid-call, again and again: the confirmed prefix is
// deleted, the rest fail, and no failure counts against a row (MaxAttempts 1
// would quarantine it at the first). Then nothing is confirmed
// for two calls. Once the broker is back every row goes out once.
func TestRelayBatchPublisherOutageMidBatchQuarantinesNothing(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		const (
			batchSize = 10
			accepted  = 6
		)
		br := newConfirmBroker()
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: br, Logger: testenv.Logger(t), BatchSize: batchSize, MaxAttempts: 1,
			ErrorBackoff: time.Millisecond, MaxErrorBackoff: 4 * time.Millisecond,
		})
		require.NoError(t, err)
		rows := b.alternating(t, "row", 0, 2*batchSize)
		for c := range 20 {
			rows = append(rows, b.alternating(t, "row", len(rows), accepted)...)
			time.Sleep(10 * time.Millisecond) // every failed row is due again
			before, calls := b.pending(t, b.db), br.callCount()
			br.script(upTo(accepted), upTo(0), upTo(0))
			n, err := relay.Flush(b.ctx)
			require.ErrorIs(t, err, errBrokerDown, "cycle %d: the outage begins mid-call", c)
			require.Equal(t, accepted, n, "cycle %d: the confirmed prefix is relayed", c)
			require.Len(t, br.lastCall(), batchSize, "cycle %d: every row of the batch was in the call", c)
			require.Equal(t, before-accepted, b.pending(t, b.db), "cycle %d: the prefix is deleted, the rest stays", c)
			for range 2 { // the outage goes on: nothing confirmed
				n, err := relay.Flush(b.ctx)
				require.Zero(t, n)
				if err != nil {
					require.ErrorIs(t, err, errBrokerDown)
				}
			}
			// A topic that failed is paused (topicPauses): the outage's
			// later polls may make no call; their steps are dropped.
			require.GreaterOrEqual(t, br.callCount(), calls+1, "cycle %d", c)
			br.unscript()
			require.Zero(t, b.permanentFailures(t), "cycle %d: a failure counted against a healthy row", c)
			require.Empty(t, b.quarantined(t), "cycle %d", c)
		}
		deadline := time.Now().Add(20 * time.Second)
		for b.pending(t, b.db) > 0 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
			_, err := relay.Flush(b.ctx)
			require.NoError(t, err)
		}
		br.requireConfirmedOnce(t, rows)
		require.Zero(t, relay.Stats().Quarantined)
	})
}

// Nothing confirmed: the broker looks down. No row is deleted or counted
// against, each has its failure recorded and waits out its backoff, and its
// topics are paused. The broker back, every row goes out.
func TestRelayBatchPublisherNothingConfirmed(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		rows := b.alternating(t, "row", 0, 10)
		br := newConfirmBroker()
		br.script(upTo(0))
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: br, Logger: testenv.Logger(t), MaxAttempts: 1,
			// Long enough that the next call comes before the backoff
			// ends even on a loaded machine.
			ErrorBackoff: 600 * time.Millisecond, MaxErrorBackoff: 600 * time.Millisecond,
		})
		require.NoError(t, err)
		n, err := relay.Flush(b.ctx)
		require.ErrorIs(t, err, errBrokerDown)
		require.Contains(t, err.Error(), "10 failed and wait for a retry")
		require.Zero(t, n)
		require.Len(t, br.lastCall(), 10, "every row was in the call")
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, int64(10), p.Failing)
		require.Zero(t, p.Quarantined)
		require.Zero(t, b.permanentFailures(t))
		require.Equal(t, outbox.RelayStats{Batches: 1, Failures: 1, FailedPublishes: 10, LastError: relay.Stats().LastError}, relay.Stats())

		// Every row waits out its backoff: nothing is due.
		n, err = relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Zero(t, n)
		require.Equal(t, 1, br.callCount())

		// The rows due, the topics are still paused.
		b.makeDue(t)
		n, err = relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Zero(t, n)
		require.Equal(t, 1, br.callCount())

		time.Sleep(650 * time.Millisecond) // the pauses end
		n, err = relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Equal(t, 10, n)
		br.requireConfirmedOnce(t, rows)
		require.Zero(t, b.pending(t, b.db))
	})
}

// The relay's context ends while the call waits for confirms: the confirmed
// messages' rows are still deleted and committed, the others are left as
// they were (the failures may be the cancellation's doing: not recorded),
// and the error is the context's, not counted as a failure.
func TestRelayBatchPublisherCancelledMidCall(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		rows := b.alternating(t, "row", 0, 10)
		br := newConfirmBroker()
		ctx, cancel := context.WithCancel(b.ctx)
		defer cancel()
		br.script(cancelAfter(3, cancel))
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: br, Logger: testenv.Logger(t)})
		require.NoError(t, err)

		n, err := relay.Flush(ctx)
		require.ErrorIs(t, err, context.Canceled)
		require.Equal(t, 3, n, "the confirmed messages' rows are deleted")
		require.Equal(t, int64(7), b.pending(t, b.db))
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Zero(t, p.Failing, "no failure recorded: the rows are due again at once")
		require.Zero(t, relay.Stats().Failures, "a shutdown is not a failure")
		require.Equal(t, int64(3), relay.Stats().Relayed)

		_, err = relay.Flush(ctx)
		require.ErrorIs(t, err, context.Canceled)
		require.Equal(t, 1, br.callCount(), "a cancelled context makes no call")

		n, err = relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Equal(t, 7, n)
		br.requireConfirmedOnce(t, rows)
	})
}

// A row whose metadata cannot be decoded is quarantined at once and is not
// part of the call; the rows behind it are relayed.
func TestRelayBatchPublisherUnreadableMetadata(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.exec(t, "INSERT INTO "+b.tables.Outbox()+b.sql(` (topic, uuid, payload, metadata) VALUES ('t', 'u', '\x7b7d', '[1, 2]')`,
			` (topic, uuid, payload, metadata, created_at) VALUES ('t', 'u', X'7b7d', '[1, 2]', UTC_TIMESTAMP(6))`))
		want := mixedMessages(3)
		b.publishAll(t, want)
		br := newConfirmBroker()
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: br, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		n, err := relay.Flush(b.ctx)
		require.ErrorContains(t, err, "unreadable metadata")
		require.Equal(t, 3, n)
		require.Equal(t, want, br.got)
		require.Len(t, br.lastCall(), 3, "the unreadable row is not published")
		require.Equal(t, []string{"t/u"}, b.quarantined(t))
		require.Equal(t, int64(1), relay.Stats().Quarantined)

		// Only unreadable rows: quarantined, no call at all.
		b.exec(t, "INSERT INTO "+b.tables.Outbox()+b.sql(` (topic, uuid, payload, metadata) VALUES ('t', 'v', '\x7b7d', '"x"')`,
			` (topic, uuid, payload, metadata, created_at) VALUES ('t', 'v', X'7b7d', '"x"', UTC_TIMESTAMP(6))`))
		n, err = relay.Flush(b.ctx)
		require.ErrorContains(t, err, "unreadable metadata")
		require.Zero(t, n)
		require.Equal(t, 1, br.callCount())
		require.Equal(t, []string{"t/u", "t/v"}, b.quarantined(t))
	})
}

// shortBatch is a broken BatchPublisher: it returns fewer outcomes than
// messages.
type shortBatch struct{ nopPublisher }

func (shortBatch) PublishBatch(_ context.Context, batch []msgid.TopicMessage) []error {
	return make([]error, len(batch)-1)
}

// A publisher that breaks the contract (one outcome per message) confirms
// nothing: no row is deleted, each has a failure recorded.
func TestRelayBatchPublisherWrongOutcomeCount(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.goodRows(t, "t", "row", 0, 4)
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: shortBatch{}, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		n, err := relay.Flush(b.ctx)
		require.ErrorContains(t, err, "returned 3 outcomes for 4 messages")
		require.Zero(t, n)
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, int64(4), p.Failing)
	})
}

// lostInFlight is the error of a message whose confirm was lost with the
// connection: not the message's own failure (nothing marks it permanent).
type lostInFlight struct{}

func (lostInFlight) Error() string { return "connection lost before the confirm" }

// interleaved confirms the even messages of a call and loses the odd ones'
// confirms with the connection: confirms of messages in flight together
// arrive in any order, so the lost ones sit between confirmed ones.
func interleaved(_ context.Context, i int) error {
	if i%2 == 0 {
		return nil
	}
	return lostInFlight{}
}

// TestRelayBatchPublisherConnectionLostQuarantinesNothing: a connection lost
// with a window in flight fails messages between confirmed ones. Their
// position says nothing about them, and their errors are not theirs: with
// MaxAttempts 1 no row is quarantined, and every row is relayed in the end.
func TestRelayBatchPublisherConnectionLostQuarantinesNothing(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		br := newConfirmBroker()
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: br, Logger: testenv.Logger(t), BatchSize: 10, MaxAttempts: 1,
			ErrorBackoff: time.Millisecond, MaxErrorBackoff: 2 * time.Millisecond,
		})
		require.NoError(t, err)
		b.alternating(t, "row", 0, 30)
		for range 5 {
			br.script(interleaved)
			_, _ = relay.Flush(b.ctx)
			b.makeDue(t)
		}
		require.Zero(t, b.permanentFailures(t), "a lost confirm counted against a healthy row")
		require.Empty(t, b.quarantined(t))
		for i := 0; b.pending(t, b.db) > 0; i++ {
			require.Less(t, i, 100, "the outbox does not drain")
			b.makeDue(t)
			_, err := relay.Flush(b.ctx)
			require.NoError(t, err)
		}
	})
}
