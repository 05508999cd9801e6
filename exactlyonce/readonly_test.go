package exactlyonce_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// readOnlyLog keeps the messages of the Error lines a middleware logs.
type readOnlyLog struct {
	watermill.NopLogger
	mu     sync.Mutex
	errors []string
}

func (l *readOnlyLog) Error(msg string, _ error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.errors = append(l.errors, msg)
}

func (l *readOnlyLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func (l *readOnlyLog) lines() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.errors...)
}

// TestReadOnlyDatabase: a server that refuses writes (here a role whose
// sessions are read-only, default_transaction_read_only, as a hot standby's
// are) refuses the claim with 25006. The middleware says so with its own
// error (ErrDBReadOnly, not ErrClaimFailed nor ErrDBUnavailable), never
// runs the handler (not even with FailOpen: the database is there), waits
// NackDelay before returning, and logs one episode for many deliveries, in
// both modes that claim in the handler's transaction, transactional and
// group commit. (Lease mode's claim begins READ WRITE, which such a role
// allows and a standby refuses: see TestReadOnlyLeaseCompletion.)
func TestReadOnlyDatabase(t *testing.T) {
	t.Parallel()
	tables := testenv.Schema(t)
	roURL := testenv.DatabaseURLWithRoleSettings(t, map[string]string{"default_transaction_read_only": "on"})
	for _, d := range testenv.DriversFor(t, roURL) {
		for _, mode := range []string{"transactional", "group-commit"} {
			t.Run(d.Name+"/"+mode, func(t *testing.T) {
				t.Parallel()
				log := &readOnlyLog{}
				var events atomic.Int64
				cfg := exactlyonce.Config{DB: testenv.WithConn(tables, d.DB), Consumer: "c-" + mode, FailOpen: mode == "transactional",
					NackDelay: 20 * time.Millisecond, Logger: log, OnEvent: func(e exactlyonce.Event) { events.Add(1) }}
				if mode == "group-commit" {
					cfg.Batch = &exactlyonce.BatchConfig{MaxSize: 10}
				}
				eo, err := exactlyonce.New(cfg)
				require.NoError(t, err)
				var runs atomic.Int64
				h := eo.Middleware(func(*message.Message) ([]*message.Message, error) {
					runs.Add(1)
					return nil, nil
				})
				const deliveries = 5
				for i := range deliveries {
					start := time.Now()
					_, err := h(message.NewMessage(watermill.NewUUID(), nil))
					took := time.Since(start)
					require.ErrorIs(t, err, exactlyonce.ErrDBReadOnly, "delivery %d", i)
					require.NotErrorIs(t, err, exactlyonce.ErrClaimFailed)
					require.NotErrorIs(t, err, exactlyonce.ErrDBUnavailable)
					require.Contains(t, err.Error(), "target_session_attrs=read-write", "the error says what to do")
					require.GreaterOrEqual(t, took, 20*time.Millisecond, "returned after NackDelay: %v", err)
				}
				require.Zero(t, runs.Load(), "the handler never runs on a read-only database")
				require.Equal(t, int64(deliveries), events.Load())
				require.Len(t, log.lines(), 1, "one episode, not a line per message: %q", log.lines())
				require.Contains(t, log.lines()[0], "refuses writes")
			})
		}
	}
}

// TestReadOnlyHandlerWrite: a write of the handler refused because the
// transaction became read-only (here the handler's own SET TRANSACTION
// READ ONLY after the claim) is nacked with ErrDBReadOnly after NackDelay,
// nothing of it committed, in both modes.
func TestReadOnlyHandlerWrite(t *testing.T) {
	t.Parallel()
	tables := testenv.Schema(t)
	ctx := context.Background()
	_, err := tables.Conn.ExecContext(ctx, "CREATE TABLE "+tables.Schema+".effects (k text)")
	require.NoError(t, err)
	for _, mode := range []string{"transactional", "group-commit"} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			cfg := exactlyonce.Config{DB: tables, Consumer: "c-" + mode, NackDelay: 20 * time.Millisecond, Logger: &readOnlyLog{}}
			if mode == "group-commit" {
				cfg.Batch = &exactlyonce.BatchConfig{MaxSize: 10}
			}
			eo, err := exactlyonce.New(cfg)
			require.NoError(t, err)
			h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				if err := exactlyonce.Exec(msg.Context(), "SET TRANSACTION READ ONLY"); err != nil {
					return nil, err
				}
				return nil, exactlyonce.Exec(msg.Context(), "INSERT INTO "+tables.Schema+".effects VALUES ($1)", msg.UUID)
			})
			msg := message.NewMessage(watermill.NewUUID(), nil)
			start := time.Now()
			_, err = h(msg)
			require.ErrorIs(t, err, exactlyonce.ErrDBReadOnly)
			require.GreaterOrEqual(t, time.Since(start), 20*time.Millisecond, "returned after NackDelay")
			require.Zero(t, testenv.Count(t, tables.Conn, "SELECT count(*) FROM "+tables.Inbox()+" WHERE message_key = $1", msg.UUID), "nothing committed")
			require.False(t, errors.Is(err, exactlyonce.ErrClaimFailed))
		})
	}
}

// TestReadOnlyLeaseCompletion: lease mode, the completion refused because
// the server is read-only (the role's sessions are; the lease claim, which
// begins READ WRITE through a pgx pool, went through) is not parked, as a completion that
// can never commit is: the primary would take it. It is nacked with
// ErrDBReadOnly after NackDelay, and the key stays processing until its
// lease expires (then it runs again as an interrupted attempt).
func TestReadOnlyLeaseCompletion(t *testing.T) {
	t.Parallel()
	tables := testenv.Schema(t)
	roURL := testenv.DatabaseURLWithRoleSettings(t, map[string]string{"default_transaction_read_only": "on"})
	for _, d := range testenv.DriversFor(t, roURL) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			log := &readOnlyLog{}
			consumer := "c-" + d.Name
			eo, err := exactlyonce.New(exactlyonce.Config{DB: testenv.WithConn(tables, d.DB), Consumer: consumer,
				NackDelay: 20 * time.Millisecond, Logger: log, Lease: &exactlyonce.LeaseConfig{Duration: time.Minute}})
			require.NoError(t, err)
			h := eo.Middleware(func(*message.Message) ([]*message.Message, error) { return nil, nil })
			for range 3 {
				msg := message.NewMessage(watermill.NewUUID(), nil)
				start := time.Now()
				_, err = h(msg)
				require.ErrorIs(t, err, exactlyonce.ErrDBReadOnly)
				require.GreaterOrEqual(t, time.Since(start), 20*time.Millisecond, "returned after NackDelay: %v", err)
				// pgx's pool begins the claim READ WRITE (it commits, the
				// completion is refused); pgx's database/sql driver does
				// not (the claim is refused, as on a standby).
				require.Zero(t, testenv.Count(t, tables.Conn, "SELECT count(*) FROM "+tables.Inbox()+
					" WHERE consumer = $1 AND message_key = $2 AND status <> 'processing'", consumer, msg.UUID),
					"not parked, not done: processing until the lease expires, or not claimed")
			}
			require.Len(t, log.lines(), 1, "one episode, not a line per message: %q", log.lines())
		})
	}
}
