package outbox_test

// Failure accounting of the relay: rows behind a failing row keep flowing, a
// row the broker can never take (its publisher says so: exactlyonce.Permanent) is
// quarantined whatever its neighbours did, and an outage (every publish
// failing, even when it begins in the middle of a batch) quarantines
// nothing.

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// badHeader marks a message the scripted broker refuses for good (as
// RabbitMQ refuses a header name over 255 bytes), with an error marked
// exactlyonce.Permanent.
const badHeader = "x-test-refused"

// scriptedBroker is a message.Publisher whose state the test scripts: it
// refuses for good every message with badHeader (a permanent error: the
// message's own), and while a budget is set
// it accepts that many more messages and then fails every publish (a broker
// outage beginning at that point) until the budget is changed. It counts
// the messages it accepted, by UUID and topic.
type scriptedBroker struct {
	mu       sync.Mutex
	budget   int // < 0: no limit
	accepted map[string]int
	order    []string
	calls    int
}

func newScriptedBroker() *scriptedBroker {
	return &scriptedBroker{budget: -1, accepted: map[string]int{}}
}

func (s *scriptedBroker) Publish(topic string, msgs ...*message.Message) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls++
	for _, m := range msgs {
		if m.Metadata.Get(badHeader) != "" {
			return exactlyonce.Permanent(fmt.Errorf("message %s refused: %w", m.UUID, errUnpublishable))
		}
	}
	for _, m := range msgs {
		if s.budget == 0 {
			return errBrokerDown
		}
		if s.budget > 0 {
			s.budget--
		}
		key := topic + "/" + m.UUID
		s.accepted[key]++
		s.order = append(s.order, key)
	}
	return nil
}

func (s *scriptedBroker) Close() error { return nil }

// setBudget makes the broker accept n more messages and then fail
// everything; n < 0 means no limit (the broker is up).
func (s *scriptedBroker) setBudget(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.budget = n
}

func (s *scriptedBroker) acceptedCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.order)
}

func (s *scriptedBroker) acceptedCopy() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.accepted))
	for k, v := range s.accepted {
		out[k] = v
	}
	return out
}

// quarantined returns topic/uuid of the quarantined rows, in id order.
func (b bundle) quarantined(t testing.TB) []string {
	t.Helper()
	rs, err := b.db.QueryContext(b.ctx, b.sql("SELECT topic || '/' || uuid FROM ", "SELECT CONCAT(topic, '/', uuid) FROM ")+b.tables.Outbox()+" WHERE quarantined_at IS NOT NULL ORDER BY id")
	require.NoError(t, err)
	var out []string
	for rs.Next() {
		var s string
		require.NoError(t, rs.Scan(&s))
		out = append(out, s)
	}
	require.NoError(t, seam.Close(rs))
	return out
}

// permanentFailures is the sum of the attempts column: the failures that
// were the messages' own.
func (b bundle) permanentFailures(t testing.TB) int64 {
	t.Helper()
	var n int64
	require.NoError(t, seam.QueryRow(b.ctx, b.db, "SELECT coalesce(sum(attempts), 0) FROM "+b.tables.Outbox(), nil, &n))
	return n
}

// goodRows writes n messages to topic (with UUIDs prefix-<i>, from first)
// in one transaction and returns their topic/uuid keys.
func (b bundle) goodRows(t testing.TB, topic, prefix string, first, n int) []string {
	t.Helper()
	msgs := make([]*message.Message, n)
	keys := make([]string, n)
	for i := range msgs {
		uuid := fmt.Sprintf("%s-%05d", prefix, first+i)
		msgs[i] = message.NewMessage(uuid, []byte("{}"))
		keys[i] = topic + "/" + uuid
	}
	b.publish(t, topic, msgs...)
	return keys
}

// alternating writes n messages alternating between topics a and b, one
// Publish call each, so that every row is a group of its own in a batch.
func (b bundle) alternating(t testing.TB, prefix string, first, n int) []string {
	t.Helper()
	var keys []string
	tx := b.begin(t)
	pub, err := b.publisher(tx)
	require.NoError(t, err)
	for i := first; i < first+n; i++ {
		topic := []string{"a", "b"}[i%2]
		uuid := fmt.Sprintf("%s-%05d", prefix, i)
		require.NoError(t, pub.Publish(topic, message.NewMessage(uuid, []byte("{}"))))
		keys = append(keys, topic+"/"+uuid)
	}
	require.NoError(t, tx.Commit())
	return keys
}

// requireEachOnce requires that the broker accepted every key in want
// exactly once, and nothing else but the keys in also.
func requireEachOnce(t *testing.T, br *scriptedBroker, want []string) {
	t.Helper()
	got := br.acceptedCopy()
	var missing, twice []string
	for _, k := range want {
		switch got[k] {
		case 0:
			missing = append(missing, k)
		case 1:
		default:
			twice = append(twice, k)
		}
		delete(got, k)
	}
	require.Empty(t, missing, "%d of %d healthy rows were never relayed", len(missing), len(want))
	require.Empty(t, twice, "rows relayed more than once")
	require.Empty(t, got, "the broker accepted messages that are not healthy rows")
}

// requireEachAtLeastOnce requires that the broker accepted every key in
// want, and nothing else.
func requireEachAtLeastOnce(t *testing.T, br *scriptedBroker, want []string) {
	t.Helper()
	got := br.acceptedCopy()
	var missing []string
	for _, k := range want {
		if got[k] == 0 {
			missing = append(missing, k)
		}
		delete(got, k)
	}
	require.Empty(t, missing, "%d of %d healthy rows were never relayed", len(missing), len(want))
	require.Empty(t, got, "the broker accepted messages that are not healthy rows")
}

// A poison row at the head and BatchSize 1: the rows behind it are relayed
// while it waits out its backoff, and its permanent failures quarantine it.
func TestRelayPoisonRowFirstBatchSizeOne(t *testing.T) {
	t.Parallel()
	eachEngine(t, relayPoisonRowFirstBatchSizeOne(asIs))
}

// relayPoisonRowFirstBatchSizeOne is the scenario of TestRelayPoisonRowFirstBatchSizeOne, its publisher wrapped by wrap.
func relayPoisonRowFirstBatchSizeOne(wrap publisherAs) func(t *testing.T, b bundle) {
	return func(t *testing.T, b bundle) {
		br := newScriptedBroker()
		poison := message.NewMessage("poison", []byte("{}"))
		poison.Metadata.Set(badHeader, "1")
		b.publish(t, "t", poison)
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: wrap(br), Logger: testenv.Logger(t), BatchSize: 1, MaxAttempts: 3,
			ErrorBackoff: time.Millisecond, MaxErrorBackoff: 50 * time.Millisecond,
		})
		require.NoError(t, err)

		var good []string
		good = append(good, b.goodRows(t, "t", "good", 0, 50)...)
		deadline := time.Now().Add(30 * time.Second)
		calls, relayedBeforeQuarantine := 0, -1
		for ; calls < 3000 && time.Now().Before(deadline); calls++ {
			q := b.quarantined(t)
			pending := b.pending(t, b.db)
			if len(q) > 0 && relayedBeforeQuarantine < 0 {
				relayedBeforeQuarantine = br.acceptedCount()
			}
			if len(q) > 0 && pending == 1 {
				break
			}
			// Keep rows flowing behind it until it is quarantined.
			if len(q) == 0 && pending < 10 && len(good) < 2000 {
				good = append(good, b.goodRows(t, "t", "good", len(good), 20)...)
			}
			_, _ = relay.Flush(b.ctx)
		}
		t.Logf("%d Flush calls, %d good rows, %d relayed before the quarantine", calls, len(good), relayedBeforeQuarantine)
		require.Positive(t, br.acceptedCount(), "no row behind the poison row was relayed")
		requireEachOnce(t, br, good)
		require.Equal(t, []string{"t/poison"}, b.quarantined(t), "the poison row is quarantined")
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, outbox.Pending{Count: 1, Quarantined: 1}, p)
		require.Equal(t, int64(1), relay.Stats().Quarantined)
		var attempts, failures int
		require.NoError(t, seam.QueryRow(b.ctx, b.db, "SELECT attempts, failures FROM "+b.tables.Outbox(), nil, &attempts, &failures))
		require.Equal(t, 3, attempts, "quarantined at MaxAttempts permanent failures")
		t.Logf("poison row quarantined after %d failures", failures)
	}
}

// Both outputs of one message, fanned out to two topics, carry the same
// header the broker refuses: a batch of only bad rows. Good rows written
// later flow, and both bad rows are quarantined.
func TestRelayBatchOfOnlyBadRows(t *testing.T) {
	t.Parallel()
	eachEngine(t, relayBatchOfOnlyBadRows(asIs))
}

// relayBatchOfOnlyBadRows is the scenario of TestRelayBatchOfOnlyBadRows, its publisher wrapped by wrap.
func relayBatchOfOnlyBadRows(wrap publisherAs) func(t *testing.T, b bundle) {
	return func(t *testing.T, b bundle) {
		br := newScriptedBroker()
		tx := b.begin(t)
		pub, err := b.publisher(tx)
		require.NoError(t, err)
		for _, topic := range []string{"a", "b"} {
			out := message.NewMessage("fanned-out", []byte("{}"))
			out.Metadata.Set(badHeader, "1")
			require.NoError(t, pub.Publish(topic, out))
		}
		require.NoError(t, tx.Commit())

		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: wrap(br), Logger: testenv.Logger(t), MaxAttempts: 2,
			ErrorBackoff: 5 * time.Millisecond, MaxErrorBackoff: 40 * time.Millisecond,
		})
		require.NoError(t, err)
		n, err := relay.Flush(b.ctx)
		require.ErrorIs(t, err, errUnpublishable)
		require.Zero(t, n)

		var good []string
		deadline := time.Now().Add(30 * time.Second)
		calls := 0
		for ; calls < 3000 && time.Now().Before(deadline); calls++ {
			q := b.quarantined(t)
			if len(q) == 2 && b.pending(t, b.db) == 2 {
				break
			}
			if len(q) < 2 && len(good) < 1000 {
				good = append(good, b.alternating(t, "good", len(good), 1)...)
			}
			_, _ = relay.Flush(b.ctx)
			time.Sleep(time.Millisecond)
		}
		t.Logf("%d Flush calls, %d good rows", calls, len(good))
		require.Positive(t, br.acceptedCount(), "no good row was relayed behind the batch of bad rows")
		requireEachOnce(t, br, good)
		require.Equal(t, []string{"a/fanned-out", "b/fanned-out"}, b.quarantined(t), "both bad rows are quarantined")
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, outbox.Pending{Count: 2, Quarantined: 2}, p)
		require.Equal(t, int64(2), relay.Stats().Quarantined)
	}
}

// The broker accepts the first messages of a batch and then fails every
// publish (an outage beginning mid-batch), over and over. With MaxAttempts
// 1, a single failure counted against a healthy row would quarantine it:
// none is, and once the outage ends every row is relayed.
func TestRelayOutageOnsetsQuarantineNoHealthyRow(t *testing.T) {
	t.Parallel()
	eachEngine(t, relayOutageOnsetsQuarantineNoHealthyRow(asIs))
}

// relayOutageOnsetsQuarantineNoHealthyRow is the scenario of TestRelayOutageOnsetsQuarantineNoHealthyRow, its publisher wrapped by wrap.
func relayOutageOnsetsQuarantineNoHealthyRow(wrap publisherAs) func(t *testing.T, b bundle) {
	return func(t *testing.T, b bundle) {
		const (
			batchSize = 10
			accepted  = 6 // per onset: the rows failed at the previous one (4) come first
			cycles    = 25
		)
		br := newScriptedBroker()
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: wrap(br), Logger: testenv.Logger(t), BatchSize: batchSize, MaxAttempts: 1,
			ErrorBackoff: time.Millisecond, MaxErrorBackoff: 4 * time.Millisecond,
		})
		require.NoError(t, err)
		rows := b.alternating(t, "row", 0, 2*batchSize)
		for c := range cycles {
			rows = append(rows, b.alternating(t, "row", len(rows), accepted)...)
			time.Sleep(10 * time.Millisecond) // every failed row is due again
			br.setBudget(accepted)
			n, err := relay.Flush(b.ctx)
			require.ErrorIs(t, err, errBrokerDown, "cycle %d: the outage begins mid-batch", c)
			// A call of several rows of one topic that the outage cut
			// leaves rows the broker took counted as failed: at-least-once.
			require.LessOrEqual(t, n, accepted, "cycle %d", c)
			require.Positive(t, n, "cycle %d", c)
			for range 2 { // the outage goes on
				n, err := relay.Flush(b.ctx)
				require.Zero(t, n)
				if err != nil {
					require.ErrorIs(t, err, errBrokerDown)
				}
			}
			require.Zero(t, b.permanentFailures(t), "cycle %d: a failure counted against a healthy row", c)
			require.Empty(t, b.quarantined(t), "cycle %d", c)
		}

		// The outage ends: everything goes out.
		br.setBudget(-1)
		deadline := time.Now().Add(20 * time.Second)
		for b.pending(t, b.db) > 0 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
			_, err := relay.Flush(b.ctx)
			require.NoError(t, err)
		}
		requireEachAtLeastOnce(t, br, rows)
		require.Zero(t, b.pending(t, b.db))
		require.Zero(t, relay.Stats().Quarantined)
	}
}

// A flapping broker (runs of good batches, an outage beginning mid-batch,
// the outage going on) and a poison row at the head: the poison row is
// quarantined, no healthy row is, and every healthy row is relayed once.
func TestRelayFlappingBrokerQuarantinesOnlyThePoisonRow(t *testing.T) {
	t.Parallel()
	eachEngine(t, relayFlappingBrokerQuarantinesOnlyThePoisonRow(asIs))
}

// relayFlappingBrokerQuarantinesOnlyThePoisonRow is the scenario of TestRelayFlappingBrokerQuarantinesOnlyThePoisonRow, its publisher wrapped by wrap.
func relayFlappingBrokerQuarantinesOnlyThePoisonRow(wrap publisherAs) func(t *testing.T, b bundle) {
	return func(t *testing.T, b bundle) {
		const batchSize = 10
		br := newScriptedBroker()
		poison := message.NewMessage("poison", []byte("{}"))
		poison.Metadata.Set(badHeader, "1")
		b.publish(t, "b", poison)
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: wrap(br), Logger: testenv.Logger(t), BatchSize: batchSize, MaxAttempts: 1,
			ErrorBackoff: time.Millisecond, MaxErrorBackoff: 4 * time.Millisecond,
		})
		require.NoError(t, err)

		var rows []string
		step := func(newRows, budget int) {
			rows = append(rows, b.alternating(t, "row", len(rows), newRows)...)
			time.Sleep(10 * time.Millisecond) // every failed row is due again
			br.setBudget(budget)
			_, _ = relay.Flush(b.ctx)
		}
		quarantinedAt := -1
		for c := 0; c < 40 && (quarantinedAt < 0 || c < quarantinedAt+5); c++ {
			step(4, -1) // up: three batches drain the backlog
			step(4, -1)
			step(4, -1)
			step(8, 5) // an outage begins mid-batch: 5 accepted, 3 fail
			step(4, 0) // and goes on
			step(4, 0)
			q := b.quarantined(t)
			if len(q) > 0 && quarantinedAt < 0 {
				quarantinedAt = c
			}
		}
		t.Logf("poison row quarantined in cycle %d", quarantinedAt)

		br.setBudget(-1)
		deadline := time.Now().Add(20 * time.Second)
		for b.pending(t, b.db) > 1 && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
			_, _ = relay.Flush(b.ctx)
		}
		requireEachOnce(t, br, rows)
		require.Equal(t, []string{"b/poison"}, b.quarantined(t), "only the poison row is quarantined")
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, outbox.Pending{Count: 1, Quarantined: 1}, p)
		require.Equal(t, int64(1), relay.Stats().Quarantined)
	}
}

// After an outage, every row has failed once and is due again, and no new
// row arrives: a poison row fanned out to two topics heads the batch. Its
// two failures must not read as "the broker is down" and stop the batch
// before the healthy rows behind it: a row that failed before says nothing
// about the broker. (Found by the chaos suite: the relay tried only the two
// poison rows, every poll, and the 279 healthy rows behind them never left.)
func TestRelayRetriesBehindFailingPairAreTried(t *testing.T) {
	t.Parallel()
	eachEngine(t, relayRetriesBehindFailingPairAreTried(asIs))
}

// relayRetriesBehindFailingPairAreTried is the scenario of TestRelayRetriesBehindFailingPairAreTried, its publisher wrapped by wrap.
func relayRetriesBehindFailingPairAreTried(wrap publisherAs) func(t *testing.T, b bundle) {
	return func(t *testing.T, b bundle) {
		br := newScriptedBroker()
		tx := b.begin(t)
		pub, err := b.publisher(tx)
		require.NoError(t, err)
		for _, topic := range []string{"a", "b"} {
			out := message.NewMessage("fanned-out", []byte("{}"))
			out.Metadata.Set(badHeader, "1")
			require.NoError(t, pub.Publish(topic, out))
		}
		require.NoError(t, tx.Commit())
		good := b.alternating(t, "good", 0, 20)
		// The outage's history: every row failed once, and its backoff ended.
		b.exec(t, "UPDATE "+b.tables.Outbox()+" SET failures = 1, last_error = 'not connected', next_attempt_at = NULL")

		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: wrap(br), Logger: testenv.Logger(t), BatchSize: 50, MaxAttempts: 2,
			ErrorBackoff: time.Microsecond, MaxErrorBackoff: time.Microsecond,
		})
		require.NoError(t, err)
		for range 5 {
			_, _ = relay.Flush(b.ctx)
		}
		requireEachOnce(t, br, good)
		require.Equal(t, int64(2), b.pending(t, b.db), "only the poison rows are left")
	}
}

// An outage begins mid-batch and goes on for a while, new rows arriving;
// then the broker comes back for a moment, takes two messages of the next
// batch, and dies again. Each failed row had messages accepted before and
// after some of its failures, yet every failure was the broker's: none may
// count against a row. (The timing-based rule this relay once had
// quarantined 24 healthy rows here with MaxAttempts 1.)
func TestRelayOutageAfterBriefRecoveryQuarantinesNothing(t *testing.T) {
	t.Parallel()
	eachEngine(t, relayOutageAfterBriefRecoveryQuarantinesNothing(asIs))
}

// relayOutageAfterBriefRecoveryQuarantinesNothing is the scenario of TestRelayOutageAfterBriefRecoveryQuarantinesNothing, its publisher wrapped by wrap.
func relayOutageAfterBriefRecoveryQuarantinesNothing(wrap publisherAs) func(t *testing.T, b bundle) {
	return func(t *testing.T, b bundle) {
		br := newScriptedBroker()
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: wrap(br), Logger: testenv.Logger(t), BatchSize: 50, MaxAttempts: 1,
			ErrorBackoff: 30 * time.Millisecond, MaxErrorBackoff: 30 * time.Millisecond,
		})
		require.NoError(t, err)
		var rows []string
		for c := range 10 {
			// Onset mid-batch: 3 rows accepted, the other 5 fail.
			rows = append(rows, b.alternating(t, fmt.Sprint("c", c), 0, 8)...)
			br.setBudget(3)
			_, _ = relay.Flush(b.ctx)
			// The outage goes on: the failed rows are due again, and new rows
			// keep arriving; whatever the relay tries fails.
			br.setBudget(0)
			time.Sleep(40 * time.Millisecond)
			rows = append(rows, b.alternating(t, fmt.Sprint("n", c), 0, 4)...)
			_, _ = relay.Flush(b.ctx)
			_, _ = relay.Flush(b.ctx)
			// The broker comes back for a moment: it takes two messages of
			// the next batch and dies again.
			time.Sleep(40 * time.Millisecond)
			rows = append(rows, b.alternating(t, fmt.Sprint("e", c), 0, 4)...)
			br.setBudget(2)
			_, _ = relay.Flush(b.ctx)
			require.Empty(t, b.quarantined(t), "cycle %d: a healthy row was quarantined", c)
			require.Zero(t, b.permanentFailures(t), "cycle %d: a failure counted against a healthy row", c)
			br.setBudget(-1)
			for range 5 {
				time.Sleep(35 * time.Millisecond)
				_, _ = relay.Flush(b.ctx)
			}
		}
		requireEachOnce(t, br, rows)
		require.Zero(t, b.pending(t, b.db))
	}
}

// Several relays (two Relay values, 3 workers each, as two instances would
// run them) share one outbox while rows keep arriving, a poison row is among
// them, and the broker goes down and comes back several times: the poison
// row (refused with a permanent error) is quarantined,
// no healthy row is (MaxAttempts 1), and every healthy row is relayed once.
func TestRelayWorkersAndInstancesQuarantineOnlyThePoison(t *testing.T) {
	t.Parallel()
	eachEngine(t, relayWorkersAndInstancesQuarantineOnlyThePoison(asIs))
}

// relayWorkersAndInstancesQuarantineOnlyThePoison is the scenario of TestRelayWorkersAndInstancesQuarantineOnlyThePoison, its publisher wrapped by wrap.
func relayWorkersAndInstancesQuarantineOnlyThePoison(wrap publisherAs) func(t *testing.T, b bundle) {
	return func(t *testing.T, b bundle) {
		br := newScriptedBroker()
		for range 2 {
			relay, err := outbox.NewRelay(outbox.RelayConfig{
				DB: b.schema(), Publisher: wrap(br), Logger: testenv.Logger(t), BatchSize: 10, Workers: 3, MaxAttempts: 1,
				PollInterval: 2 * time.Millisecond, ErrorBackoff: 5 * time.Millisecond, MaxErrorBackoff: 40 * time.Millisecond,
			})
			require.NoError(t, err)
			runRelay(t, relay)
		}
		tx := b.begin(t)
		pub, err := b.publisher(tx)
		require.NoError(t, err)
		poison := message.NewMessage("poison", []byte("{}"))
		poison.Metadata.Set(badHeader, "1")
		require.NoError(t, pub.Publish("a", poison))
		require.NoError(t, tx.Commit())

		var rows []string
		for c := range 8 {
			for range 5 {
				rows = append(rows, b.alternating(t, fmt.Sprint("r", c, "-", len(rows)), len(rows), 10)...)
				time.Sleep(10 * time.Millisecond)
			}
			br.setBudget(7) // an outage beginning after 7 more messages, mid-batch; 150 ms, rows still arriving
			rows = append(rows, b.alternating(t, fmt.Sprint("o", c), len(rows), 10)...)
			time.Sleep(150 * time.Millisecond)
			br.setBudget(-1)
		}
		testenv.Eventually(t, 30*time.Second, func() bool {
			return b.pending(t, b.db) == 1 && len(b.quarantined(t)) == 1
		}, "every healthy row relayed and the poison row quarantined")
		require.Equal(t, []string{"a/poison"}, b.quarantined(t), "no healthy row is quarantined")
		requireEachOnce(t, br, rows)
	}
}
