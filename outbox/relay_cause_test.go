package outbox_test

// A row is quarantined only for a cause that is the message's own. These
// scenarios script a broker whose failures are its own state (an outage, a
// blip, a flapping connection): whatever the timing of other rows'
// acceptance around them, and with MaxAttempts 1, no row is quarantined, and
// every row is relayed once the broker takes messages again.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// errTransient is a failure of the broker's, not of the message (a
// connection lost, a timeout, a nack): nothing marks it as the message's own.
var errTransient = errors.New("connection lost before the confirm (test)")

// stepBroker is a message.Publisher whose outcome for each message is
// decided by a script, called with the message, in publish order. A
// Publish call stops at its first failing message (those before it were
// accepted, as with a real broker). It records what it accepted.
type stepBroker struct {
	mu       sync.Mutex
	script   func(topic string, m *message.Message) error
	accepted map[string]int
}

func newStepBroker(script func(topic string, m *message.Message) error) *stepBroker {
	return &stepBroker{script: script, accepted: map[string]int{}}
}

func (s *stepBroker) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		s.mu.Lock()
		script := s.script
		s.mu.Unlock()
		if err := script(topic, m); err != nil {
			return err
		}
		s.mu.Lock()
		s.accepted[topic+"/"+m.UUID]++
		s.mu.Unlock()
	}
	return nil
}

func (s *stepBroker) Close() error { return nil }

func (s *stepBroker) setScript(script func(topic string, m *message.Message) error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.script = script
}

func (s *stepBroker) requireEachOnce(t *testing.T, want []string) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, k := range want {
		require.Equal(t, 1, s.accepted[k], "%s accepted once", k)
	}
	require.Len(t, s.accepted, len(want), "nothing else accepted")
}

func up(string, *message.Message) error   { return nil }
func down(string, *message.Message) error { return errTransient }

// makeDue makes the failed rows due now, whatever their backoff.
func (b bundle) makeDue(t testing.TB) {
	t.Helper()
	b.exec(t, "UPDATE "+b.tables.Outbox()+b.sql(" SET next_attempt_at = now() - interval '1 second'", " SET next_attempt_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND")+
		" WHERE next_attempt_at IS NOT NULL")
}

// holdBack keeps the failed rows from being due for a long while.
func (b bundle) holdBack(t testing.TB) {
	t.Helper()
	b.exec(t, "UPDATE "+b.tables.Outbox()+b.sql(" SET next_attempt_at = now() + interval '1 hour'", " SET next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR")+
		" WHERE next_attempt_at IS NOT NULL")
}

// drain relays until the outbox is empty, making failed rows due.
func (b bundle) drain(t *testing.T, relay *outbox.Relay) {
	t.Helper()
	for i := 0; b.pending(t, b.db) > 0; i++ {
		require.Less(t, i, 200, "the outbox does not drain")
		b.makeDue(t)
		_, _ = relay.Flush(b.ctx)
	}
}

// The broker takes 3 messages of a batch of 10, fails the next 3 (its
// connection is being re-established), then takes the rest. The 3 rows that
// failed are healthy: with MaxAttempts 1 none is quarantined, and each is
// relayed at its next attempt.
func TestRelayBlipInsideBatchQuarantinesNothing(t *testing.T) {
	t.Parallel()
	for name, wrap := range map[string]publisherAs{"Publish": asIs, "PublishBatch": asBatch} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			eachEngine(t, func(t *testing.T, b bundle) {
				rows := b.alternating(t, "row", 0, 10)
				n := 0
				br := newStepBroker(func(string, *message.Message) error {
					n++
					if n > 3 && n <= 6 {
						return errTransient
					}
					return nil
				})
				relay, err := outbox.NewRelay(outbox.RelayConfig{
					DB: b.schema(), Publisher: wrap(br), Logger: testenv.Logger(t), BatchSize: 10, MaxAttempts: 1,
				})
				require.NoError(t, err)

				relayed, err := relay.Flush(b.ctx)
				require.ErrorIs(t, err, errTransient)
				require.Equal(t, 7, relayed)
				require.Empty(t, b.quarantined(t), "a blip of the broker's quarantines no row")
				require.Zero(t, relay.Stats().Quarantined)

				b.drain(t, relay)
				br.requireEachOnce(t, rows)
				require.Empty(t, b.quarantined(t))
			})
		})
	}
}

// The broker flaps: row X fails as the last publish of its batch at the
// onset of an outage, other rows flow while the broker is up, and X is
// retried exactly as the next outage begins, cycle after cycle. Its
// failures are the broker's: with the default MaxAttempts it is never
// quarantined, and it is relayed once the broker stays up.
func TestRelayFlappingRetriedAtOutageOnsetQuarantinesNothing(t *testing.T) {
	t.Parallel()
	for name, wrap := range map[string]publisherAs{"Publish": asIs, "PublishBatch": asBatch} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			eachEngine(t, func(t *testing.T, b bundle) {
				for _, batchSize := range []int{1, 100} {
					b.exec(t, "DELETE FROM "+b.tables.Outbox())
					br := newStepBroker(up)
					relay, err := outbox.NewRelay(outbox.RelayConfig{
						DB: b.schema(), Publisher: wrap(br), Logger: testenv.Logger(t), BatchSize: batchSize,
						ErrorBackoff: time.Millisecond, MaxErrorBackoff: time.Millisecond, // X's topic pause
					})
					require.NoError(t, err)
					x := fmt.Sprintf("x-%d", batchSize)
					b.publish(t, "x", message.NewMessage(x, []byte("{}")))
					want := []string{"x/" + x}
					for cycle := range 12 {
						// The outage begins as X is retried: its only row.
						br.setScript(down)
						b.makeDue(t)
						time.Sleep(2 * time.Millisecond) // its topic's pause ended
						_, err := relay.Flush(b.ctx)
						require.ErrorIs(t, err, errTransient, "cycle %d", cycle)
						require.Empty(t, b.quarantined(t), "cycle %d: X is quarantined for the broker's outages", cycle)
						// The broker is up: other rows flow while X waits.
						br.setScript(up)
						b.holdBack(t)
						want = append(want, b.goodRows(t, "y", fmt.Sprintf("y-%d-%d", batchSize, cycle), 0, 3)...)
						for b.pending(t, b.db) > 1 {
							_, err := relay.Flush(b.ctx)
							require.NoError(t, err)
						}
					}
					b.drain(t, relay)
					br.requireEachOnce(t, want)
					require.Zero(t, relay.Stats().Quarantined)
				}
			})
		})
	}
}

// Two relays share the table. Relay B's message is accepted before an
// outage begins, but B deletes its row and commits only after relay A
// recorded row X's failure at the outage's onset; X's next attempt is still
// in the outage. Nothing about X is its own: with MaxAttempts 1 it is not
// quarantined.
func TestRelayTwoRelaysOneOutageQuarantinesNothing(t *testing.T) {
	t.Parallel()
	for name, wrap := range map[string]publisherAs{"Publish": asIs, "PublishBatch": asBatch} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			eachEngine(t, func(t *testing.T, b bundle) {
				// In id order: Y (relay B's), W and X (relay A's); each its own topic.
				b.publish(t, "y", message.NewMessage("y", []byte("{}")))
				b.publish(t, "w", message.NewMessage("w", []byte("{}")))
				b.publish(t, "x", message.NewMessage("x", []byte("{}")))

				var (
					mu         sync.Mutex
					isDown     bool
					yAccepted  = make(chan struct{})
					releaseY   = make(chan struct{})
					yCompleted bool
				)
				br := newStepBroker(func(topic string, m *message.Message) error {
					mu.Lock()
					defer mu.Unlock()
					switch {
					case m.UUID == "y" && !yCompleted:
						// Accepted; B's Publish returns only when released.
						yCompleted = true
						close(yAccepted)
						mu.Unlock()
						<-releaseY
						mu.Lock()
						return nil
					case isDown:
						return errTransient
					case m.UUID == "w":
						isDown = true // the outage begins right after W
					}
					return nil
				})
				pub := wrap(br)
				relayA, err := outbox.NewRelay(outbox.RelayConfig{
					DB: b.schema(), Publisher: pub, Logger: testenv.Logger(t), BatchSize: 2, MaxAttempts: 1,
					ErrorBackoff: time.Millisecond, MaxErrorBackoff: time.Millisecond, // X's topic pause
				})
				require.NoError(t, err)
				relayB, err := outbox.NewRelay(outbox.RelayConfig{
					DB: b.schema(), Publisher: pub, Logger: testenv.Logger(t), BatchSize: 1, MaxAttempts: 1,
				})
				require.NoError(t, err)

				bDone := make(chan error, 1)
				go func() {
					_, err := relayB.Flush(context.Background())
					bDone <- err
				}()
				<-yAccepted
				relayedA, err := relayA.Flush(b.ctx) // W accepted, X fails: the outage began
				require.ErrorIs(t, err, errTransient)
				require.Equal(t, 1, relayedA)
				close(releaseY)
				require.NoError(t, <-bDone)

				b.makeDue(t)
				time.Sleep(2 * time.Millisecond) // X's topic pause ended
				_, err = relayA.Flush(b.ctx)     // still in the outage
				require.ErrorIs(t, err, errTransient)
				require.Empty(t, b.quarantined(t), "X is quarantined for an outage")

				mu.Lock()
				isDown = false
				mu.Unlock()
				b.drain(t, relayA)
				br.requireEachOnce(t, []string{"y/y", "w/w", "x/x"})
			})
		})
	}
}

// A destination that is not taking messages (here a row its publisher
// fails without marking it the message's own) delays no other topic: its
// topic is paused (and the row waits out its backoff), while Run goes on
// relaying the others at once, however long ErrorBackoff is.
func TestRelayRunFailingTopicDelaysNoOtherTopic(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.publish(t, "t", message.NewMessage("poison", []byte("{}")))
		br := newStepBroker(func(_ string, m *message.Message) error {
			if m.UUID == "poison" {
				return errTransient
			}
			return nil
		})
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: br, Logger: testenv.Logger(t), NoListen: true, PollInterval: 20 * time.Millisecond,
			ErrorBackoff: 20 * time.Second, MaxErrorBackoff: 20 * time.Second,
		})
		require.NoError(t, err)
		runRelay(t, relay)
		testenv.Eventually(t, 10*time.Second, func() bool { return relay.Stats().FailedPublishes >= 1 }, "the poison row failed")
		b.publish(t, "u", message.NewMessage("fresh", []byte("{}")))
		testenv.Eventually(t, 5*time.Second, func() bool { return b.pending(t, b.db) == 1 },
			"a row of another topic waits behind a failing one")
		br.requireEachOnce(t, []string{"u/fresh"})
	})
}

// A long run of rows of one destination the broker is not taking (a full
// or missing queue: failures that are not the messages' own) heads the
// outbox. The rows of other topics behind it flow at once: the failing
// topic is paused, not the relay.
func TestRelayFailingTopicRunHoldsNoOtherTopic(t *testing.T) {
	t.Parallel()
	for name, wrap := range map[string]publisherAs{"Publish": asIs, "PublishBatch": asBatch} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			eachEngine(t, func(t *testing.T, b bundle) {
				b.goodRows(t, "full", "bad", 0, 1000)
				want := b.goodRows(t, "ok", "good", 0, 5)
				br := newStepBroker(func(topic string, _ *message.Message) error {
					if topic == "full" {
						return errTransient
					}
					return nil
				})
				relay, err := outbox.NewRelay(outbox.RelayConfig{
					DB: b.schema(), Publisher: wrap(br), Logger: testenv.Logger(t), NoListen: true,
					PollInterval: 10 * time.Millisecond, ErrorBackoff: 50 * time.Millisecond, MaxErrorBackoff: 400 * time.Millisecond,
				})
				require.NoError(t, err)
				runRelay(t, relay)
				testenv.Eventually(t, 5*time.Second, func() bool { return b.pending(t, b.db) == 1000 },
					"the rows of a healthy topic wait behind 1,000 rows of a failing one")
				br.requireEachOnce(t, want)
				require.Empty(t, b.quarantined(t))
			})
		})
	}
}

// BatchSize 1: rows that keep failing (each failure taking a moment, as a
// publish timeout does) and come due again and again do not starve a
// healthy row: retried and fresh rows take turns.
func TestRelayBatchSizeOneFailingRowsStarveNothing(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		for i := range 12 {
			// Each its own topic: no pause holds them back as a group.
			b.publish(t, fmt.Sprintf("slow-%d", i), message.NewMessage(fmt.Sprintf("bad-%d", i), []byte("{}")))
		}
		br := newStepBroker(func(topic string, _ *message.Message) error {
			if strings.HasPrefix(topic, "slow-") {
				time.Sleep(50 * time.Millisecond)
				return errTransient
			}
			return nil
		})
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: br, Logger: testenv.Logger(t), BatchSize: 1, NoListen: true,
			PollInterval: 10 * time.Millisecond, ErrorBackoff: 50 * time.Millisecond, MaxErrorBackoff: 400 * time.Millisecond,
		})
		require.NoError(t, err)
		runRelay(t, relay)
		testenv.Eventually(t, 10*time.Second, func() bool { return relay.Stats().FailedPublishes >= 24 }, "the failing rows failed twice each")
		b.publish(t, "ok", message.NewMessage("good", []byte("{}")))
		testenv.Eventually(t, 5*time.Second, func() bool { return b.pending(t, b.db) == 12 },
			"a healthy row starves behind rows that keep failing")
		br.requireEachOnce(t, []string{"ok/good"})
	})
}

// The batch's statement walks the primary key under the generic plan of a
// prepared statement (what pgx and database/sql use after a few runs),
// whatever the backlog: a filter on the paused topics that the planner can
// estimate read, on a table of one topic, as "no row matches", and the
// plan scanned and sorted the whole backlog for every batch (5.6 times
// slower at 20k rows).
func TestRelaySelectWalksThePrimaryKey(t *testing.T) {
	t.Parallel()
	b := newBundle(t, context.Background(), testenv.Drivers(t)[0].DB, testenv.Schema(t))
	b.exec(t, "INSERT INTO "+b.tables.Outbox()+` (topic, uuid, payload) SELECT 'one', 'u' || g, '\x7b7d' FROM generate_series(1, 20000) g`)
	b.exec(t, "ANALYZE "+b.tables.Outbox())
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: newStepBroker(up), Logger: testenv.Logger(t)})
	require.NoError(t, err)
	tx := b.begin(t)
	_, err = tx.ExecContext(b.ctx, "SET LOCAL plan_cache_mode = force_generic_plan")
	require.NoError(t, err)
	_, err = tx.ExecContext(b.ctx, "PREPARE relay_batch(int, int, text[], int) AS "+outbox.SelectSQL(relay))
	require.NoError(t, err)
	_, err = tx.ExecContext(b.ctx, "PREPARE relay_plain(int, int, text[]) AS "+outbox.PlainSQL(relay))
	require.NoError(t, err)
	for _, paused := range []string{"{}", "{other}"} {
		plan := testenv.Explain(b.ctx, t, tx, "EXPLAIN EXECUTE relay_batch(100, 50, '"+paused+"', 400)")
		require.NotContains(t, plan, "Seq Scan", "paused %s:\n%s", paused, plan)
		require.Contains(t, plan, "_pkey", "paused %s:\n%s", paused, plan)
		// The statement of a table without keyed rows, too.
		plan = testenv.Explain(b.ctx, t, tx, "EXPLAIN EXECUTE relay_plain(100, 50, '"+paused+"')")
		require.NotContains(t, plan, "Seq Scan", "plain statement, paused %s:\n%s", paused, plan)
		require.Contains(t, plan, "_pkey", "plain statement, paused %s:\n%s", paused, plan)
	}
	// PREPARE outlives the transaction on its server connection (which
	// PgBouncer in transaction mode gives to other tests).
	_, err = tx.ExecContext(b.ctx, "DEALLOCATE relay_batch")
	require.NoError(t, err)
	_, err = tx.ExecContext(b.ctx, "DEALLOCATE relay_plain")
	require.NoError(t, err)
}

// A batch's statements are never JIT-compiled. Their cost estimates grow
// with the table (a LIMIT computed in the statement reads as a tenth of
// it): past jit_above_cost, PostgreSQL compiled the statement of a batch of
// 500 rows for every batch, 25 ms and more, and at a 1M-row backlog the
// relay fell from 12k to 2.4k events/s. Here jit_above_cost 0 stands for a
// table that large.
func TestRelayBatchIsNotJITCompiled(t *testing.T) {
	t.Parallel()
	b := newBundle(t, context.Background(), testenv.Drivers(t)[0].DB, testenv.Schema(t))
	b.exec(t, "INSERT INTO "+b.tables.Outbox()+` (topic, uuid, payload) SELECT 'one', 'u' || g, '\x7b7d' FROM generate_series(1, 1000) g`)
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: newStepBroker(up), Logger: testenv.Logger(t)})
	require.NoError(t, err)
	tx := b.begin(t)
	defer func() { _ = tx.Rollback() }()
	_, err = tx.ExecContext(b.ctx, "SET LOCAL jit_above_cost = 0")
	require.NoError(t, err)
	keyed, err := outbox.HasKeyedRows(b.ctx, relay, tx)
	require.NoError(t, err)
	require.False(t, keyed)
	var jit string
	rows, err := tx.QueryContext(b.ctx, "SELECT current_setting('jit')")
	require.NoError(t, err)
	require.True(t, rows.Next())
	require.NoError(t, rows.Scan(&jit))
	require.NoError(t, rows.Close())
	require.Equal(t, "off", jit, "the batch's transaction runs without JIT")

	name := "relay_jit_" + strings.ReplaceAll(watermill.NewShortUUID(), "-", "")
	_, err = tx.ExecContext(b.ctx, "PREPARE "+name+"(int, int, text[]) AS "+outbox.PlainSQL(relay))
	require.NoError(t, err)
	plan := testenv.Explain(b.ctx, t, tx, "EXPLAIN (ANALYZE) EXECUTE "+name+"(500, 250, '{}')")
	require.NotContains(t, plan, "JIT:", plan)
	_, err = tx.ExecContext(b.ctx, "DEALLOCATE "+name)
	require.NoError(t, err)
}

// With several workers, the failed rows another worker has locked take no
// room in this worker's batch: it fills the batch with the rows it can
// lock. (They were counted as due although locked: the batch came out
// short, which reads as "caught up", and the worker slept a poll interval
// with a backlog waiting.)
func TestRelayRetryRowsLockedElsewhereShrinkNoBatch(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.goodRows(t, "retry", "r", 0, 50)
		b.exec(t, "UPDATE "+b.tables.Outbox()+b.sql(" SET failures = 1, next_attempt_at = now() - interval '1 second'",
			" SET failures = 1, next_attempt_at = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND"))
		b.goodRows(t, "fresh", "f", 0, 200)
		other := b.begin(t) // another worker's batch holds the failed rows
		_, err := other.ExecContext(b.ctx, "SELECT id FROM "+b.tables.Outbox()+" WHERE failures > 0 FOR UPDATE")
		require.NoError(t, err)

		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: newStepBroker(up), Logger: testenv.Logger(t), BatchSize: 100})
		require.NoError(t, err)
		n, err := relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Equal(t, 100, n, "a full batch of the rows this worker can lock")
		require.NoError(t, other.Rollback())
	})
}
