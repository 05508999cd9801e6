package cluster_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// countingPublisher counts what the relay publishes, per message UUID.
type countingPublisher struct {
	mu   sync.Mutex
	uuid map[string]int
}

func (p *countingPublisher) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.uuid[m.UUID]++
	}
	return nil
}

func (p *countingPublisher) Close() error { return nil }

func (p *countingPublisher) distinct() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.uuid)
}

// roConsumer is a router whose middleware writes on the standby, with
// what it saw.
type roConsumer struct {
	readOnly  atomic.Int64 // deliveries nacked with ErrDBReadOnly
	other     atomic.Int64 // deliveries nacked with anything else
	processed atomic.Int64
	lastOther atomic.Value
}

// TestReadOnlyStandby: the middleware (one transaction per message, group
// commit, lease mode) and the outbox relay pointed at the standby of a real pair
// (node b before promotion, its own URL: a hot standby takes the
// connection and refuses every write) fail clearly and do not loop: each
// delivery is nacked with ErrDBReadOnly after NackDelay (a handful of
// claims in the window, not thousands), the relay's batches fail with
// ErrDBReadOnly once every MaxErrorBackoff, nothing is acked, published,
// quarantined or counted against a row. When the standby is promoted, the
// same running routers and relay go on and finish: every message
// processed once, every outbox row published.
func TestReadOnlyStandby(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	p := pgPair(t)
	// remote_apply: what is committed on a is visible on b.
	require.NoError(t, p.SetReplication(ctx, "a", "remote_apply"))
	apool, err := pgxpool.New(ctx, p.NodeURL("a"))
	require.NoError(t, err)
	defer apool.Close()
	adb := sqlschema.DB{Conn: wsql.BeginnerFromPgx(apool), Schema: "ro"}
	require.NoError(t, sqlschema.Migrate(ctx, adb))
	adb = adb.WithDefaults()
	_, err = apool.Exec(ctx, "CREATE TABLE ro.effects (msg_id text NOT NULL)")
	require.NoError(t, err)
	// Outbox rows, written on the primary.
	const rows = 5
	w, err := outbox.NewWriter(adb)
	require.NoError(t, err)
	tx, err := adb.Conn.BeginTx(ctx, nil)
	require.NoError(t, err)
	op, err := w.Publisher(tx)
	require.NoError(t, err)
	for i := range rows {
		require.NoError(t, op.Publish("ro-out", message.NewMessage(fmt.Sprintf("row-%d", i), nil)))
	}
	require.NoError(t, tx.Commit())

	bpool, err := pgxpool.New(ctx, p.NodeURL("b"))
	require.NoError(t, err)
	defer bpool.Close()
	bdb := sqlschema.DB{Conn: wsql.BeginnerFromPgx(bpool), Schema: "ro"}.WithDefaults()
	var inRecovery bool
	require.NoError(t, bpool.QueryRow(ctx, "SELECT pg_is_in_recovery()").Scan(&inRecovery))
	require.True(t, inRecovery, "node b is a standby")

	const nackDelay = 200 * time.Millisecond
	const window = 2 * time.Second
	const messages = 3
	modes := []string{"transactional", "group-commit", "lease"}
	consumers := map[string]*roConsumer{}
	for _, mode := range modes {
		c := &roConsumer{}
		consumers[mode] = c
		cfg := exactlyonce.Config{DB: bdb, Consumer: "ro-" + mode, NackDelay: nackDelay, Logger: testenv.Logger(t),
			OnEvent: func(e exactlyonce.Event) {
				switch {
				case e.Outcome == exactlyonce.Processed:
					c.processed.Add(1)
				case errors.Is(e.Err, exactlyonce.ErrDBReadOnly):
					c.readOnly.Add(1)
				default:
					c.other.Add(1)
					c.lastOther.Store(fmt.Sprint(e.Outcome, e.Err))
				}
			}}
		switch mode {
		case "group-commit":
			cfg.Batch = &exactlyonce.BatchConfig{MaxSize: 8}
		case "lease":
			cfg.Lease = &exactlyonce.LeaseConfig{Duration: time.Minute}
		}
		eo, err := exactlyonce.New(cfg)
		require.NoError(t, err)
		ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
		r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
		require.NoError(t, err)
		r.AddMiddleware(eo.Middleware)
		r.AddConsumerHandler("ro-"+mode, "in", ps, func(msg *message.Message) error {
			return exactlyonce.Exec(msg.Context(), "INSERT INTO ro.effects (msg_id) VALUES ($1)", msg.UUID)
		})
		testenv.StartRouter(t, r)
		for i := range messages {
			require.NoError(t, ps.Publish("in", message.NewMessage(fmt.Sprintf("%s-%d", mode, i), nil)))
		}
	}

	pub := &countingPublisher{uuid: map[string]int{}}
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: bdb, Publisher: pub, Workers: 1, ErrorBackoff: 50 * time.Millisecond,
		MaxErrorBackoff: nackDelay, PollInterval: 100 * time.Millisecond, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	relayCtx, relayCancel := context.WithCancel(ctx)
	var relayWG sync.WaitGroup
	relayWG.Go(func() { _ = relay.Run(relayCtx) })
	defer func() { relayCancel(); relayWG.Wait() }()

	// The window on the standby.
	time.Sleep(window)
	// At most one claim per NackDelay for each message in flight (the Go
	// channel delivers them at once), two more for the window's edges: a
	// loop would make thousands.
	bound := int64(messages * (window/nackDelay + 2))
	for _, mode := range modes {
		c := consumers[mode]
		require.Zero(t, c.other.Load(), "%s: only ErrDBReadOnly: %v", mode, c.lastOther.Load())
		require.Zero(t, c.processed.Load(), "%s: nothing processed on a standby", mode)
		require.Positive(t, c.readOnly.Load(), "%s: deliveries nacked with ErrDBReadOnly", mode)
		require.LessOrEqual(t, c.readOnly.Load(), bound, "%s: no hot loop", mode)
		t.Logf("%s: %d deliveries nacked with ErrDBReadOnly in %s (NackDelay %s)", mode, c.readOnly.Load(), window, nackDelay)
	}
	st := relay.Stats()
	require.ErrorIs(t, st.LastError, outbox.ErrDBReadOnly, "the relay says the database is read-only")
	require.ErrorIs(t, st.LastError, exactlyonce.ErrDBReadOnly)
	require.Positive(t, st.Failures)
	require.LessOrEqual(t, st.Failures, int64(window/nackDelay)+3, "one batch per MaxErrorBackoff: no hot loop")
	require.Zero(t, st.Relayed)
	require.Zero(t, st.Quarantined)
	require.Zero(t, pub.distinct(), "nothing published from a standby")
	t.Logf("relay: %d batches failed with ErrDBReadOnly in %s (MaxErrorBackoff %s): %v", st.Failures, window, nackDelay, st.LastError)
	var touched int
	require.NoError(t, bpool.QueryRow(ctx, "SELECT count(*) FROM "+bdb.Outbox()+" WHERE failures > 0 OR attempts > 0 OR quarantined_at IS NOT NULL").Scan(&touched))
	require.Zero(t, touched, "no failure counted against a row")

	// The standby is promoted: the same routers and relay go on.
	apool.Close()
	require.NoError(t, p.Crash("a"))
	require.NoError(t, p.Promote("b"))
	for _, mode := range modes {
		c := consumers[mode]
		testenv.Eventually(t, 30*time.Second, func() bool { return c.processed.Load() == messages }, "%s: every message processed after the promotion", mode)
	}
	testenv.Eventually(t, 30*time.Second, func() bool { return pub.distinct() == rows }, "the relay published every row after the promotion")
	b, err := pgx.Connect(ctx, p.NodeURL("b"))
	require.NoError(t, err)
	defer func() { _ = b.Close(ctx) }()
	var effects, distinct int
	require.NoError(t, b.QueryRow(ctx, "SELECT count(*), count(DISTINCT msg_id) FROM ro.effects").Scan(&effects, &distinct))
	require.Equal(t, len(modes)*messages, effects, "every message has one effect")
	require.Equal(t, len(modes)*messages, distinct)
	require.Zero(t, relay.Stats().Quarantined)
}
