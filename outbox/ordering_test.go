package outbox_test

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// keyed returns a message of ordering key key with sequence number seq (in
// its metadata and UUID).
func keyed(key string, seq int) *message.Message {
	m := message.NewMessage(fmt.Sprintf("%s-%03d", key, seq), []byte(strconv.Itoa(seq)))
	m.Metadata.Set("seq", strconv.Itoa(seq))
	return msgid.SetOrderingKey(m, key)
}

// acceptLog records, in the order a publisher accepted them, the messages of
// each ordering key, and checks per-key order: a message is accepted only
// after every earlier message of its key (repeats of earlier ones are
// allowed: at-least-once).
type acceptLog struct {
	mu       sync.Mutex
	accepted map[string][]int // key -> seqs, in acceptance order
	total    int
}

func newAcceptLog() *acceptLog { return &acceptLog{accepted: map[string][]int{}} }

func (l *acceptLog) add(msg *message.Message) {
	seq, _ := strconv.Atoi(msg.Metadata.Get("seq"))
	l.mu.Lock()
	defer l.mu.Unlock()
	k := msgid.OrderingKey(msg)
	if k == "" {
		k = msg.Metadata.Get("key") // the unordered runs' key
	}
	l.accepted[k] = append(l.accepted[k], seq)
	l.total++
}

// violations lists, per key, the acceptances of a message before an
// earlier one of its key (seq 1, 2, ...), skipping the seqs in skip.
func (l *acceptLog) violations(skip map[string]map[int]bool) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for k, seqs := range l.accepted {
		next := 1
		for _, s := range seqs {
			for skip[k][next] {
				next++
			}
			switch {
			case s < next: // a repeat of an earlier message
			case s == next:
				next++
			default:
				out = append(out, fmt.Sprintf("key %s: %d accepted before %d", k, s, next))
			}
		}
	}
	slices.Sort(out)
	if len(out) > 20 {
		out = append(out[:20], fmt.Sprintf("and %d more", len(out)-20))
	}
	return out
}

func (l *acceptLog) distinct() map[string][]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := map[string][]int{}
	for k, seqs := range l.accepted {
		seen := map[int]bool{}
		for _, s := range seqs {
			if !seen[s] {
				seen[s] = true
				out[k] = append(out[k], s)
			}
		}
	}
	return out
}

// flakyBroker accepts or refuses each message on its own, at random (a
// refusal that is not the message's own: the row is retried), after a
// random delay; it implements both message.Publisher and
// outbox.BatchPublisher, and says message by message what it accepted.
type flakyBroker struct {
	log      *acceptLog
	failRate float64
	mu       sync.Mutex
	rng      *mrand.Rand
	refuse   func(msg *message.Message) error // a refusal decided by the test
}

func (f *flakyBroker) outcome(msg *message.Message) error {
	if f.refuse != nil {
		if err := f.refuse(msg); err != nil {
			return err
		}
	}
	f.mu.Lock()
	fail := f.rng.Float64() < f.failRate
	delay := time.Duration(f.rng.IntN(300)) * time.Microsecond
	f.mu.Unlock()
	time.Sleep(delay)
	if fail {
		return errBrokerDown
	}
	f.log.add(msg)
	return nil
}

func (f *flakyBroker) PublishBatch(_ context.Context, batch []msgid.TopicMessage) []error {
	errs := make([]error, len(batch))
	for i, tm := range batch {
		errs[i] = f.outcome(tm.Message)
	}
	return errs
}

func (f *flakyBroker) Close() error { return nil }

// plainBroker is flakyBroker without PublishBatch: the relay's
// message.Publisher path (a call of several messages may take some and
// fail).
type plainBroker struct{ *flakyBroker }

func (p plainBroker) Publish(_ string, msgs ...*message.Message) error {
	var first error
	for _, m := range msgs {
		if err := p.outcome(m); err != nil && first == nil {
			first = err
		}
	}
	return first
}

func (f *flakyBroker) Publish(_ string, msgs ...*message.Message) error {
	return plainBroker{f}.Publish("", msgs...)
}

// waitingForKey counts the transactions waiting for an ordering key's lock
// of db's outbox table (no other test's locks): on PostgreSQL an advisory
// lock of the table's lock class; on MySQL a session in the statement that
// upserts rows of the table's key-lock table (which takes no time unless
// it waits: PROCESSLIST, as MariaDB's INNODB_TRX does not always list a
// transaction waiting in its first write).
func waitingForKey(t *testing.T, b bundle) int64 {
	if b.mysql() {
		keyLocks := b.tables.Dialect.QuoteIdentifier(b.tables.Schema, b.tables.OutboxTable+"_key_locks")
		return testenv.Count(t, b.db, `SELECT count(*) FROM information_schema.PROCESSLIST WHERE command = 'Execute' AND info LIKE ?`,
			"%INSERT INTO "+keyLocks+"%")
	}
	return testenv.Count(t, b.db, `SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted AND objsubid = 2
AND classid::text::bigint = ($1::bigint & 4294967295)`, int64(outbox.LockClass(b.tables)))
}

// TestOrderingKeyWritersOfOneKeyWait: a transaction writing a key waits at
// its write until another transaction that wrote the key ends; writers of
// other keys do not wait. The waiting writer draws its row's id once it has
// the key, after the commit it waited for: a row written meanwhile by a
// third transaction gets a smaller id.
func TestOrderingKeyWritersOfOneKeyWait(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		first := b.begin(t)
		pub1, err := b.w.Publisher(first)
		require.NoError(t, err)
		require.NoError(t, pub1.Publish("orders", keyed("A", 1)))

		// Another key: no wait.
		b.publish(t, "orders", keyed("B", 1))

		done := make(chan error, 1)
		go func() {
			tx, err := b.db.BeginTx(b.ctx, nil)
			if err != nil {
				done <- err
				return
			}
			pub2, err := b.w.Publisher(tx)
			if err == nil {
				err = pub2.Publish("orders", keyed("A", 2))
			}
			if err != nil {
				_ = tx.Rollback()
				done <- err
				return
			}
			done <- tx.Commit()
		}()
		// The second writer of A waits for A's lock.
		require.Eventually(t, func() bool { return waitingForKey(t, b) == 1 }, 10*time.Second, 5*time.Millisecond,
			"the second writer of key A does not wait")
		select {
		case err := <-done:
			t.Fatalf("the second writer of key A went on while the first was open: %v", err)
		default:
		}
		b.publish(t, "orders", keyed("C", 1)) // while A-002 waits
		require.NoError(t, first.Commit())
		require.NoError(t, <-done)

		// A's rows in id order: 1, then 2, drawn after C's.
		require.Equal(t, []string{"A-001", "B-001", "C-001", "A-002"}, uuidsOf(b.rows(t)))
	})
}

// TestOrderingKeyPublishOutsideTransaction: a Publish outside a
// transaction (the Publisher bound to a pool) holds the key's lock until
// its row is committed: when a transaction took the key before the
// Publish's first statement, the Publish waits for its commit and draws
// its id after it, so the relay keeps the order of the commits. On
// PostgreSQL the lock is taken in the statement that writes the row (its
// own autocommit transaction); on MySQL the key-lock statement and the
// INSERT run in a transaction the Publish begins. (The lock was a
// statement of its own, whose lock ended before the INSERT: the INSERT
// went ahead of the open transaction, committed first with the larger id,
// and the relay published it second.)
func TestOrderingKeyPublishOutsideTransaction(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		auto := &pausingBeginner{Beginner: b.db, at: 1, reached: make(chan struct{}), release: make(chan struct{})}
		autoPub, err := b.w.Publisher(auto)
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- autoPub.Publish("orders", keyed("K", 2)) }()
		<-auto.reached // before its first statement

		tx := b.begin(t)
		txPub, err := b.w.Publisher(tx)
		require.NoError(t, err)
		require.NoError(t, txPub.Publish("orders", keyed("K", 1)))
		close(auto.release)
		require.Eventually(t, func() bool { return waitingForKey(t, b) == 1 }, 10*time.Second, 5*time.Millisecond,
			"the autocommit writer of K does not wait for the transaction holding K")
		b.publish(t, "orders", keyed("J", 1))
		require.NoError(t, tx.Commit())
		require.NoError(t, <-done)
		require.Equal(t, []string{"K-001", "J-001", "K-002"}, uuidsOf(b.rows(t)))

		if b.mysql() {
			return // TODO(issue 31): relay on MySQL once its relay is merged (wt-relay)
		}
		log := newAcceptLog()
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: &flakyBroker{log: log, rng: mrand.New(mrand.NewPCG(2, 2))},
			Logger: watermill.NopLogger{}})
		require.NoError(t, err)
		_, err = relay.Flush(b.ctx)
		require.NoError(t, err)
		require.Equal(t, []int{1, 2}, log.accepted["K"])
	})
}

// TestOrderingKeyRolledBackWriterFreesKey: a writer that rolls back lets
// the waiting one go on; nothing of the first is relayed.
func TestOrderingKeyRolledBackWriterFreesKey(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		first := b.begin(t)
		pub1, err := b.w.Publisher(first)
		require.NoError(t, err)
		require.NoError(t, pub1.Publish("orders", keyed("A", 1)))
		done := make(chan error, 1)
		go func() {
			tx, err := b.db.BeginTx(b.ctx, nil)
			if err != nil {
				done <- err
				return
			}
			pub2, _ := b.w.Publisher(tx)
			if err := pub2.Publish("orders", keyed("A", 2)); err != nil {
				_ = tx.Rollback()
				done <- err
				return
			}
			done <- tx.Commit()
		}()
		require.Eventually(t, func() bool { return waitingForKey(t, b) == 1 }, 10*time.Second, 5*time.Millisecond)
		require.NoError(t, first.Rollback())
		require.NoError(t, <-done)
		rows := b.rows(t)
		require.Len(t, rows, 1)
		require.Equal(t, "A-002", rows[0].UUID)
	})
}

// TestOrderingKeyTooLong: a key over MaxOrderingKeyBytes is refused before
// anything is written.
func TestOrderingKeyTooLong(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		tx := b.begin(t)
		pub, err := b.w.Publisher(tx)
		require.NoError(t, err)
		long := make([]byte, outbox.MaxOrderingKeyBytes+1)
		for i := range long {
			long[i] = 'k'
		}
		err = pub.Publish("orders", keyed("ok", 1), keyed(string(long), 1))
		require.ErrorContains(t, err, "ordering key is 1025 bytes, the most is 1024")
		require.NoError(t, tx.Commit())
		require.Empty(t, b.rows(t))
	})
}

// TestRelayOrderedFailingRowBlocksOnlyItsKey: a row whose publish fails
// holds back the later rows of its key, in this batch and the next ones,
// while every other key (and the rows without a key) flows; once it is
// accepted, its key follows in order. A quarantined row holds its key back
// until it is discarded or requeued.
func TestRelayOrderedFailingRowBlocksOnlyItsKey(t *testing.T) {
	t.Parallel()
	for _, batchPub := range []bool{true, false} {
		t.Run(fmt.Sprintf("BatchPublisher=%v", batchPub), func(t *testing.T) {
			t.Parallel()
			eachEngine(t, func(t *testing.T, b bundle) {
				var msgs []*message.Message
				for seq := 1; seq <= 3; seq++ {
					for _, k := range []string{"A", "B", "C"} {
						msgs = append(msgs, keyed(k, seq))
					}
					u := message.NewMessage(fmt.Sprintf("free-%d", seq), nil)
					u.Metadata.Set("seq", strconv.Itoa(seq))
					msgs = append(msgs, u)
				}
				b.publish(t, "orders", msgs...)

				log := newAcceptLog()
				var refuseMu sync.Mutex
				refuse := map[string]error{"A-001": errBrokerDown, "C-002": exactlyonce.Permanent(errUnpublishable)}
				broker := &flakyBroker{log: log, rng: mrand.New(mrand.NewPCG(1, 2)), refuse: func(m *message.Message) error {
					refuseMu.Lock()
					defer refuseMu.Unlock()
					return refuse[m.UUID]
				}}
				var pub message.Publisher = plainBroker{broker}
				if batchPub {
					pub = broker
				}
				relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: pub, Logger: watermill.NopLogger{},
					ErrorBackoff: time.Millisecond, MaxErrorBackoff: time.Millisecond, MaxAttempts: 1})
				require.NoError(t, err)
				drain := func() {
					for range 20 {
						_, _ = relay.Flush(b.ctx)
						time.Sleep(2 * time.Millisecond)
					}
				}
				drain()
				got := log.distinct()
				require.Equal(t, []int{1, 2, 3}, got["B"], "key B flows")
				require.Empty(t, got["A"], "key A waits behind its failing first row")
				require.Equal(t, []int{1}, got["C"], "key C waits behind its quarantined second row")
				require.Len(t, got[""], 3, "rows without a key flow")
				p, err := mustStore(t, b.schema()).Pending(b.ctx)
				require.NoError(t, err)
				require.Equal(t, int64(1), p.Quarantined)
				require.Equal(t, int64(1), p.Failing)

				// A's first row is accepted now: A follows, in order.
				refuseMu.Lock()
				delete(refuse, "A-001")
				refuseMu.Unlock()
				drain()
				require.Equal(t, []int{1, 2, 3}, log.distinct()["A"])
				require.Equal(t, []int{1}, log.distinct()["C"], "a quarantined row holds its key until an operator acts")

				// Discarding C's quarantined row lets C's third row go.
				page, err := mustStore(t, b.schema()).Find(b.ctx, outbox.RowFilter{UUID: "C-002"}, outbox.Page{})
				require.NoError(t, err)
				require.Len(t, page.Rows, 1)
				require.NoError(t, mustStore(t, b.schema()).Discard(b.ctx, page.Rows[0].ID, outbox.Expect{}))
				drain()
				require.Equal(t, []int{1, 3}, log.distinct()["C"])
				require.Empty(t, log.violations(map[string]map[int]bool{"C": {2: true}}))
				require.Empty(t, b.rows(t))
			})
		})
	}
}

// TestRelayOrderedRequeueKeepsOrder: a quarantined row requeued goes out
// before the rows of its key that waited behind it.
func TestRelayOrderedRequeueKeepsOrder(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.publish(t, "orders", keyed("A", 1), keyed("A", 2), keyed("A", 3))
		log := newAcceptLog()
		var refuseMu sync.Mutex
		refuse := map[string]error{"A-002": exactlyonce.Permanent(errUnpublishable)}
		broker := &flakyBroker{log: log, rng: mrand.New(mrand.NewPCG(3, 4)), refuse: func(m *message.Message) error {
			refuseMu.Lock()
			defer refuseMu.Unlock()
			return refuse[m.UUID]
		}}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: broker, Logger: watermill.NopLogger{}, MaxAttempts: 1})
		require.NoError(t, err)
		for range 5 {
			_, _ = relay.Flush(b.ctx)
		}
		require.Equal(t, []int{1}, log.distinct()["A"])
		refuseMu.Lock()
		delete(refuse, "A-002")
		refuseMu.Unlock()
		n, err := mustStore(t, b.schema()).RequeueFailed(b.ctx)
		require.NoError(t, err)
		require.Equal(t, int64(1), n)
		for range 5 {
			_, _ = relay.Flush(b.ctx)
		}
		require.Equal(t, []int{1, 2, 3}, log.distinct()["A"])
		require.Empty(t, log.violations(nil))
	})
}

// TestRelayOrderedUnreadableRowBlocksItsKey: a row quarantined at once for
// its metadata holds back its key, not the others.
func TestRelayOrderedUnreadableRowBlocksItsKey(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.publish(t, "orders", keyed("A", 1), keyed("A", 2), keyed("B", 1))
		b.exec(t, `UPDATE `+b.tables.Outbox()+` SET metadata = '{"seq": 1}' WHERE uuid = 'A-001'`)
		log := newAcceptLog()
		broker := &flakyBroker{log: log, rng: mrand.New(mrand.NewPCG(5, 6))}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: broker, Logger: watermill.NopLogger{}})
		require.NoError(t, err)
		for range 3 {
			_, _ = relay.Flush(b.ctx)
		}
		require.Equal(t, map[string][]int{"B": {1}}, log.distinct())
		require.Len(t, b.rows(t), 2)
	})
}

// orderedScenario writes keys x perKey keyed messages from writers
// concurrent transactions (each a few messages of random keys; a message's
// sequence number is its key's counter, incremented after the message was
// written, in the same transaction), while relays run.
var errKeyFull = errors.New("the key has all its messages (test)")

func orderedScenario(t *testing.T, b bundle, keys, perKey, writers int, withKeys bool) {
	t.Helper()
	counters := b.tables.Schema + ".seq_counters"
	b.exec(t, `CREATE TABLE `+counters+b.sql(` (k text PRIMARY KEY, n int NOT NULL)`, ` (k VARCHAR(16) PRIMARY KEY, n INT NOT NULL)`))
	for k := range keys {
		b.exec(t, `INSERT INTO `+counters+b.sql(` VALUES ($1, 0)`, ` VALUES (?, 0)`), fmt.Sprintf("k%03d", k))
	}
	// One transaction: a few messages of random keys. Two writers locking
	// two counters in opposite orders deadlock; PostgreSQL aborts one,
	// which rolls back as an application would, and nothing of it counts.
	// READ COMMITTED, asked for: under REPEATABLE READ (a database's
	// default may be) the counter's UPDATE after a concurrent one fails
	// with 40001, which an application retries; the key lock does not
	// depend on it.
	writeTx := func(rng *mrand.Rand) (int, error) {
		tx, err := b.db.BeginTx(b.ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
		if err != nil {
			return 0, err
		}
		defer func() { _ = tx.Rollback() }()
		wrote := 0
		for range 1 + rng.IntN(3) {
			k := fmt.Sprintf("k%03d", rng.IntN(keys))
			// In the transaction: a query on another connection would
			// need a second server connection per writer, which
			// PgBouncer's pool may not have while the transactions that
			// hold its connections wait for this writer's key.
			if n, err := countIn(b.ctx, tx, `SELECT n FROM `+counters+b.sql(` WHERE k = $1`, ` WHERE k = ?`), k); err != nil {
				return 0, err
			} else if n >= perKey {
				continue
			}
			// The message first, its sequence number after: only the
			// ordering key's lock, taken by Publish, makes the writers
			// of a key wait for each other from before the row's id is
			// drawn until the commit (the counter's row lock comes too
			// late for that).
			m := message.NewMessage(watermill.NewUUID(), nil)
			if withKeys {
				msgid.SetOrderingKey(m, k)
			} else {
				m.Metadata.Set("key", k)
			}
			if err := b.writeTo(tx, "orders", m); err != nil {
				return 0, err
			}
			var n int
			if b.mysql() { // no UPDATE ... RETURNING
				if _, err := tx.ExecContext(b.ctx, `UPDATE `+counters+` SET n = n + 1 WHERE k = ?`, k); err != nil {
					return 0, err
				}
			}
			rs, err := tx.QueryContext(b.ctx, b.sql(`UPDATE `+counters+` SET n = n + 1 WHERE k = $1 RETURNING n`, `SELECT n FROM `+counters+` WHERE k = ?`), k)
			if err != nil {
				return 0, err
			}
			if rs.Next() {
				if err := rs.Scan(&n); err != nil {
					return 0, err
				}
			}
			if err := seam.Close(rs); err != nil { // a deadlock shows here
				return 0, err
			}
			if n > perKey {
				return 0, errKeyFull // another writer completed the key meanwhile: roll back
			}
			if _, err := tx.ExecContext(b.ctx, `UPDATE `+b.tables.Outbox()+b.sql(` SET metadata = metadata || jsonb_build_object('seq', $1::text) WHERE uuid = $2`,
				` SET metadata = JSON_SET(metadata, '$.seq', ?) WHERE uuid = ?`),
				strconv.Itoa(n), m.UUID); err != nil {
				return 0, err
			}
			wrote++
		}
		if rng.IntN(10) == 0 {
			return 0, tx.Rollback()
		}
		return wrote, tx.Commit()
	}
	var wg sync.WaitGroup
	for w := range writers {
		wg.Go(func() {
			rng := mrand.New(mrand.NewPCG(uint64(w), 7))
			for b.ctx.Err() == nil {
				wrote, err := writeTx(rng)
				if err != nil && !errors.Is(err, errKeyFull) && !strings.Contains(strings.ToLower(err.Error()), "deadlock") {
					t.Errorf("writer: %v", err)
					return
				}
				if wrote == 0 && testenv.Count(t, b.db, `SELECT count(*) FROM `+counters+b.sql(` WHERE n < $1`, ` WHERE n < ?`), perKey) == 0 {
					return
				}
			}
		})
	}
	wg.Wait()
}

// TestRelayOrderedUnderConcurrency: concurrent writers, two relays with
// Workers 4 each (one through BatchPublisher, one through Publish), a
// broker that refuses a fifth of the messages at random: every key's
// messages are accepted in sequence order (repeats allowed), none is lost.
// The same scenario without ordering keys breaks the order (the check can
// fail).
func TestRelayOrderedUnderConcurrency(t *testing.T) {
	t.Parallel()
	const keys, perKey = 40, 25
	for _, ordered := range []bool{true, false} {
		t.Run(fmt.Sprintf("ordered=%v", ordered), func(t *testing.T) {
			t.Parallel()
			eachEngine(t, func(t *testing.T, b bundle) {
				log := newAcceptLog()
				ctx, cancel := context.WithCancel(b.ctx)
				var relays sync.WaitGroup
				for i, batchPub := range []bool{true, false} {
					broker := &flakyBroker{log: log, failRate: 0.2, rng: mrand.New(mrand.NewPCG(uint64(i), 9))}
					var pub message.Publisher = plainBroker{broker}
					if batchPub {
						pub = broker
					}
					relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: pub, Logger: watermill.NopLogger{},
						Workers: 4, BatchSize: 20, PollInterval: 5 * time.Millisecond, NoListen: true,
						ErrorBackoff: time.Millisecond, MaxErrorBackoff: 5 * time.Millisecond})
					require.NoError(t, err)
					relays.Go(func() { _ = relay.Run(ctx) })
				}
				orderedScenario(t, b, keys, perKey, 6, ordered)
				require.Eventually(t, func() bool { return b.pending(t, b.db) == 0 }, 30*time.Second, 20*time.Millisecond)
				cancel()
				relays.Wait()

				if !ordered {
					require.NotEmpty(t, log.violations(nil), "without ordering keys the relay does not keep per-key order: the check must see it")
					return
				}
				got := log.distinct()
				require.Len(t, got, keys)
				for k, seqs := range got {
					require.Len(t, seqs, perKey, "key %s", k)
				}
				require.Empty(t, log.violations(nil))
			})
		})
	}
}

// The batch's statement on keyed rows, under the generic plan: it walks the
// primary key for the heads, asks "an earlier row of its key?" of the
// ordering_key index, and takes the followers of the heads from it: no scan
// of the backlog per row.
func TestRelayOrderedSelectPlan(t *testing.T) {
	t.Parallel()
	b := newBundle(t, context.Background(), testenv.Drivers(t)[0].DB, testenv.Schema(t))
	b.exec(t, "INSERT INTO "+b.tables.Outbox()+` (topic, uuid, payload, ordering_key) SELECT 'one', 'u' || g, '\x7b7d', 'k' || (g % 1000) FROM generate_series(1, 20000) g`)
	b.exec(t, "UPDATE "+b.tables.Outbox()+" SET failures = 1, quarantined_at = now() WHERE id <= 3")
	b.exec(t, "ANALYZE "+b.tables.Outbox())
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: newStepBroker(up), Logger: testenv.Logger(t)})
	require.NoError(t, err)
	tx := b.begin(t)
	_, err = tx.ExecContext(b.ctx, "SET LOCAL plan_cache_mode = force_generic_plan")
	require.NoError(t, err)
	// PREPARE outlives the transaction on its server connection (which
	// PgBouncer in transaction mode gives to other tests): a name of its
	// own, deallocated after.
	_, err = tx.ExecContext(b.ctx, "PREPARE relay_batch_ordered(int, int, text[], int) AS "+outbox.SelectSQL(relay))
	require.NoError(t, err)
	plan := testenv.Explain(b.ctx, t, tx, "EXPLAIN EXECUTE relay_batch_ordered(100, 50, '{}', 400)")
	_, err = tx.ExecContext(b.ctx, "DEALLOCATE relay_batch_ordered")
	require.NoError(t, err)
	require.NotContains(t, plan, "Seq Scan", plan)
	require.Contains(t, plan, "_pkey", plan)
	require.Contains(t, plan, "Index Only Scan using "+b.tables.WithDefaults().OutboxTable+"_ordering_key on", plan)
}

// countIn reads one integer through tx (0 when no row).
func countIn(ctx context.Context, tx wsql.Tx, q string, args ...any) (int, error) {
	rs, err := tx.QueryContext(ctx, q, args...)
	if err != nil {
		return 0, err
	}
	n := 0
	if rs.Next() {
		if err := rs.Scan(&n); err != nil {
			_ = rs.Close()
			return 0, err
		}
	}
	return n, seam.Close(rs)
}
