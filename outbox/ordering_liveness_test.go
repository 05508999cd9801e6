package outbox_test

// Per-key order: a key that cannot go takes no batch room, and the
// assumptions the order rests on are checked.

import (
	"context"
	mrand "math/rand/v2"
	"sync"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// TestRelayOrderedPausedHeadTakesNoRoom: a key whose first row is in a
// paused topic has none of its rows taken, in any topic, so they do not
// fill the batches: the rows of other keys behind them go. (The relay took
// them into every batch and flagged them blocked; with BatchSize of them,
// no other key went while the topic was paused.)
func TestRelayOrderedPausedHeadTakesNoRoom(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		log := newAcceptLog()
		broker := &flakyBroker{log: log, rng: mrand.New(mrand.NewPCG(7, 7)), refuse: func(m *message.Message) error {
			if m.Metadata.Get("dest") == "down" {
				return errBrokerDown // the destination's state, not the message's
			}
			return nil
		}}
		const batch = 10
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: broker, Logger: watermill.NopLogger{},
			BatchSize: batch, ErrorBackoff: time.Minute, MaxErrorBackoff: time.Minute})
		require.NoError(t, err)

		down := func(m *message.Message) *message.Message { m.Metadata.Set("dest", "down"); return m }
		// Topic "down" fails once: it is paused for ErrorBackoff.
		b.publish(t, "down", down(keyed("X", 1)))
		_, err = relay.Flush(b.ctx)
		require.Error(t, err)

		// Key K: its first message to the paused topic, its next ones to
		// "up"; then key J, to "up", nothing to do with K.
		b.publish(t, "down", down(keyed("K", 1)))
		var ks []*message.Message
		for seq := 2; seq <= batch+1; seq++ {
			ks = append(ks, keyed("K", seq))
		}
		b.publish(t, "up", ks...)
		b.publish(t, "up", keyed("J", 1))

		for range 5 {
			_, _ = relay.Flush(b.ctx)
		}
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		t.Logf("PendingStats: BlockedKeys %d, Blocked %d (K's rows wait, not reported)", p.BlockedKeys, p.Blocked)
		require.Equal(t, []int{1}, log.distinct()["J"],
			"key J has nothing before it, yet it is not relayed: K's rows behind its paused first row fill every batch")
		require.Empty(t, log.distinct()["K"], "K's rows wait for their first row, in the paused topic")
	})
}

// blockingBroker accepts everything, but holds its first PublishBatch call
// until released: a relay with a batch in flight (a slow confirm).
type blockingBroker struct {
	log      *acceptLog
	entered  chan struct{}
	release  chan struct{}
	enteredO sync.Once
}

func (f *blockingBroker) PublishBatch(_ context.Context, batch []msgid.TopicMessage) []error {
	f.enteredO.Do(func() { close(f.entered) })
	<-f.release
	for _, tm := range batch {
		f.log.add(tm.Message)
	}
	return make([]error, len(batch))
}

func (f *blockingBroker) Publish(topic string, msgs ...*message.Message) error {
	batch := make([]msgid.TopicMessage, len(msgs))
	for i, m := range msgs {
		batch[i] = msgid.TopicMessage{Topic: topic, Message: m}
	}
	for _, err := range f.PublishBatch(context.Background(), batch) {
		if err != nil {
			return err
		}
	}
	return nil
}

func (f *blockingBroker) Close() error { return nil }

// TestRelayOrderedKeyInFlightElsewhereTakesNoRoom: while one relay has a
// hot key's first row in flight, another relay takes none of that key's
// rows, and relays the key J right behind them. (Its batches were the hot
// key's next BatchSize rows, all blocked, and J waited for the first
// relay's whole batch: BatchSize confirm rounds, or ConfirmTimeout when its
// broker connection hangs.)
func TestRelayOrderedKeyInFlightElsewhereTakesNoRoom(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		const batch = 10
		var hot []*message.Message
		for seq := 1; seq <= 2*batch; seq++ {
			hot = append(hot, keyed("H", seq))
		}
		b.publish(t, "orders", hot...)
		b.publish(t, "orders", keyed("J", 1))

		slowLog, fastLog := newAcceptLog(), newAcceptLog()
		slow := &blockingBroker{log: slowLog, entered: make(chan struct{}), release: make(chan struct{})}
		// Relay A's batch is H's first row alone (a batch takes the heads
		// of keys first: with more room, J's would be in it too).
		relayA, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: slow, Logger: watermill.NopLogger{}, BatchSize: 1})
		require.NoError(t, err)
		fast := &flakyBroker{log: fastLog, rng: mrand.New(mrand.NewPCG(8, 8))}
		relayB, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: fast, Logger: watermill.NopLogger{}, BatchSize: batch})
		require.NoError(t, err)

		done := make(chan struct{})
		go func() { defer close(done); _, _ = relayA.Flush(b.ctx) }()
		<-slow.entered // relay A holds H-001, in flight
		defer func() { close(slow.release); <-done }()

		for range 3 {
			_, _ = relayB.Flush(b.ctx)
		}
		require.Equal(t, []int{1}, fastLog.distinct()["J"],
			"key J is free, yet relay B's batches are all H's blocked rows while relay A has H in flight")
		require.Empty(t, fastLog.distinct()["H"], "relay B leaves H to relay A, which has its first row in flight")
	})
}

// TestOrderingKeySequenceCache: the relay keeps a key's order by id, and a
// key's ids follow its commits only if nextval hands out increasing values
// across sessions. With the id sequence's CACHE above 1 (a tuning for
// insert-heavy tables), each session draws from its own block, and a later
// transaction of the key gets a smaller id: shown here, and reported by the
// relay's start-up check, with the fix.
func TestOrderingKeySequenceCache(t *testing.T) {
	t.Parallel()
	b := newBundle(t, context.Background(), testenv.Drivers(t)[0].DB, testenv.Schema(t))
	d := b.tables.WithDefaults()
	seq := pgx.Identifier{d.Schema, d.OutboxTable + "_id_seq"}.Sanitize()
	b.exec(t, `ALTER SEQUENCE `+seq+` CACHE 10`)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn := func() *pgx.Conn {
		// Two sessions of PostgreSQL's own (PgBouncer in transaction
		// pooling may give both the same server session, and one cache).
		c, err := pgx.Connect(ctx, testenv.DirectDatabaseURL())
		require.NoError(t, err)
		t.Cleanup(func() { _ = c.Close(context.Background()) })
		return c
	}
	c1, c2 := conn(), conn()
	write := func(c *pgx.Conn, m *message.Message) {
		tx, err := c.Begin(ctx)
		require.NoError(t, err)
		pub, err := b.w.Publisher(wsql.TxFromPgx(tx))
		require.NoError(t, err)
		require.NoError(t, pub.Publish("orders", m))
		require.NoError(t, tx.Commit(ctx))
	}
	// Three transactions of key K, one after the other (each commits
	// before the next begins): the order is 1, 2, 3; in id order it is not.
	write(c1, keyed("K", 1))
	write(c2, keyed("K", 2))
	write(c1, keyed("K", 3))
	require.Equal(t, []string{"K-001", "K-003", "K-002"}, uuidsOf(b.rows(t)), "with CACHE 10 the ids do not follow the commits")

	logs := &logCapture{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: &recorder{}, NoListen: true, Logger: logs})
	require.NoError(t, err)
	runRelay(t, relay)
	testenv.Eventually(t, 10*time.Second, func() bool { return logs.has("ERROR outbox relay: start-up check: the outbox id sequence") },
		"the cached sequence is reported\n%s", logs)
	require.Contains(t, logs.String(), "caches 10 values per session")
	require.Contains(t, logs.String(), "CACHE 1")

	// CACHE 1 (the default): nothing to report.
	b.exec(t, `ALTER SEQUENCE `+seq+` CACHE 1`)
	logs2 := &logCapture{}
	relay2, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: &recorder{}, NoListen: true, Logger: logs2})
	require.NoError(t, err)
	runRelay(t, relay2)
	testenv.Eventually(t, 10*time.Second, func() bool { return logs2.has("INFO outbox relay: start-up check passed") }, "the check passes\n%s", logs2)
	require.NotContains(t, logs2.String(), "id sequence")
}

// The id sequence's cache is checked on the table itself, whatever made
// it: tables created from sqlschema.SQL by another migration tool (goose,
// golang-migrate, atlas) record no migration, and the relay reports a
// CACHE above 1 there too, naming the sequence and the fix.
func TestOrderingKeySequenceCacheWithoutMigrationRecords(t *testing.T) {
	t.Parallel()
	b := newBundle(t, context.Background(), testenv.Drivers(t)[0].DB, sqlschema.DB{})
	db := b.neverMigrated(t)
	script, err := sqlschema.SQL(db)
	require.NoError(t, err)
	b.exec(t, script)
	d := db.WithDefaults()
	seq := pgx.Identifier{d.Schema, d.OutboxTable + "_id_seq"}.Sanitize()
	b.exec(t, `ALTER SEQUENCE `+seq+` CACHE 20`)

	logs := &logCapture{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: &recorder{}, NoListen: true, Logger: logs})
	require.NoError(t, err)
	runRelay(t, relay)
	testenv.Eventually(t, 10*time.Second, func() bool { return logs.has("ERROR outbox relay: start-up check: the outbox id sequence") },
		"the cached sequence is reported although no migration is recorded\n%s", logs)
	require.Contains(t, logs.String(), "caches 20 values per session")
	require.Contains(t, logs.String(), "ALTER SEQUENCE "+d.Schema+"."+d.OutboxTable+"_id_seq CACHE 1", "the fix, with the sequence's name")

	// A tool that creates the sequence apart and sets the id's default to
	// it (the column owns no sequence): the one the default draws from.
	apart := pgx.Identifier{d.Schema, "outbox_ids"}.Sanitize()
	b.exec(t, `CREATE SEQUENCE `+apart+` CACHE 5`)
	b.exec(t, `ALTER TABLE `+db.Outbox()+` ALTER COLUMN id SET DEFAULT nextval('`+apart+`')`)
	b.exec(t, `ALTER SEQUENCE `+seq+` OWNED BY NONE`)
	logs2 := &logCapture{}
	relay2, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: &recorder{}, NoListen: true, Logger: logs2})
	require.NoError(t, err)
	runRelay(t, relay2)
	testenv.Eventually(t, 10*time.Second, func() bool { return logs2.has("ERROR outbox relay: start-up check: the outbox id sequence") },
		"the sequence of the id's default is reported\n%s", logs2)
	require.Contains(t, logs2.String(), "ALTER SEQUENCE "+d.Schema+".outbox_ids CACHE 1")
}

func uuidsOf(rows []row) []string {
	var out []string
	for _, r := range rows {
		out = append(out, r.UUID)
	}
	return out
}

// TestRelayOrderedLongBlockedTailsTakeNoWindow: a batch looks for heads
// among a window of the oldest rows (a few batches' worth); the rows
// waiting behind a quarantined row, or behind a head in a paused topic,
// are not in it however many they are, so the keys after them still go.
func TestRelayOrderedLongBlockedTailsTakeNoWindow(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		const batch = 10 // a window of 40 rows
		log := newAcceptLog()
		broker := &flakyBroker{log: log, rng: mrand.New(mrand.NewPCG(9, 9)), refuse: func(m *message.Message) error {
			switch {
			case m.Metadata.Get("dest") == "down":
				return errBrokerDown
			case m.UUID == "Q-001":
				return exactlyonce.Permanent(errUnpublishable)
			}
			return nil
		}}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: broker, Logger: watermill.NopLogger{},
			BatchSize: batch, MaxAttempts: 1, ErrorBackoff: time.Minute, MaxErrorBackoff: time.Minute})
		require.NoError(t, err)

		// Q's first row is quarantined; P's first row is in a topic that
		// gets paused.
		down := keyed("P", 1)
		down.Metadata.Set("dest", "down")
		b.publish(t, "down", down)
		b.publish(t, "up", keyed("Q", 1))
		for range 3 {
			_, _ = relay.Flush(b.ctx)
		}
		p, err := mustStore(t, b.schema()).Pending(b.ctx)
		require.NoError(t, err)
		require.Equal(t, int64(1), p.Quarantined)

		// Ten windows of rows behind each, then J.
		var tail []*message.Message
		for seq := 2; seq <= 2+10*4*batch; seq++ {
			tail = append(tail, keyed("Q", seq), keyed("P", seq))
		}
		b.publish(t, "up", tail...)
		b.publish(t, "up", keyed("J", 1))
		for range 3 {
			_, _ = relay.Flush(b.ctx)
		}
		require.Equal(t, []int{1}, log.distinct()["J"], "J waits behind the blocked keys' rows")
		require.Empty(t, log.distinct()["Q"])
		require.Empty(t, log.distinct()["P"])
	})
}

// TestRelayPlainStatementFlagsAKeysLaterRow: the statement for a table
// that had no keyed row when the batch probed it takes rows in id order
// without looking for heads. A keyed row committed after the probe, whose
// key's earlier row another relay has in flight, must still not go: its
// last step flags it blocked. The order does not rest on the probe's
// timing.
func TestRelayPlainStatementFlagsAKeysLaterRow(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		b.publish(t, "orders", keyed("K", 1), keyed("K", 2))
		other := b.begin(t) // another relay's batch holds K-001
		_, err := other.ExecContext(b.ctx, "SELECT id FROM "+b.tables.Outbox()+" WHERE uuid = 'K-001' FOR UPDATE")
		require.NoError(t, err)

		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: &recorder{}, Logger: watermill.NopLogger{}})
		require.NoError(t, err)
		tx := b.begin(t)
		rows, err := tx.QueryContext(b.ctx, outbox.PlainSQL(relay), 100, 50, []string{})
		require.NoError(t, err)
		got := map[string]bool{}
		for rows.Next() {
			var (
				id          int64
				topic, uuid string
				payload     []byte
				meta        string
				retry       bool
				key         *string
				blockedFlag bool
			)
			require.NoError(t, rows.Scan(&id, &topic, &uuid, &payload, &meta, &retry, &key, &blockedFlag))
			got[uuid] = blockedFlag
		}
		require.NoError(t, rows.Close())
		require.Equal(t, map[string]bool{"K-002": true}, got, "K-001 is locked elsewhere (skipped); K-002 must come flagged blocked")
		require.NoError(t, tx.Rollback())
		require.NoError(t, other.Rollback())
	})
}
