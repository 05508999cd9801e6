package exactlyonce

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlexec"
)

type ctxKey struct{}

// handlerValues is what the middleware puts in the handler's context, under
// one key (one allocation instead of one per value).
type handlerValues struct {
	tx       *txHandle
	outbox   message.Publisher
	consumer string
	key      string
	lease    *leaseState // lease mode only
	failOpen bool        // a fail-open run: no tx, no outbox
	// storeOnly is set in lease mode with a store that is not PostgreSQL:
	// no tx, no outbox; asking for them is recorded.
	storeOnly *storeOnlyUse
	queue     *[]queuedStmt // group commit with pgx: Exec defers its statements here
}

func withHandlerContext(ctx context.Context, v *handlerValues) context.Context {
	return context.WithValue(ctx, ctxKey{}, v)
}

func valuesFrom(ctx context.Context) *handlerValues {
	v, _ := ctx.Value(ctxKey{}).(*handlerValues)
	return v
}

// noDelivery is the error of a context helper given a context that carries
// no delivery of this middleware (ErrNoMiddleware). Inside a Watermill
// router the context names the handler: the middleware does not wrap it.
// Then the helpers that a handler needs for its work (not InfoFromContext)
// wait misconfiguredDelay first, so that a router without a poison queue
// does not redeliver the message in a tight loop.
func noDelivery(ctx context.Context, helper string) error {
	if name := message.HandlerNameFromCtx(ctx); name != "" {
		if helper != "InfoFromContext" { // a read-only probe: callers may ignore its error
			sleep(ctx, misconfiguredDelay)
		}
		return fmt.Errorf("exactlyonce: %s: %w: no AddMiddleware(Guard.Middleware) wraps handler %q", helper, ErrNoMiddleware, name)
	}
	return fmt.Errorf("exactlyonce: %s: %w: the context is not derived from msg.Context() of a message under the middleware", helper, ErrNoMiddleware)
}

// misconfiguredDelay is how long a delivery that can never succeed because
// of the wiring (no middleware around the handler) waits before it fails.
const misconfiguredDelay = time.Second

// errFailOpen is returned by the transaction helpers in a fail-open run.
var errFailOpen = fmt.Errorf("exactlyonce: no transaction in a fail-open run (Config.FailOpen): %w", ErrDBUnavailable)

// errStoreOnly is returned by the transaction and outbox helpers in lease
// mode with a store that is not PostgreSQL (Config.Lease.Store).
var errStoreOnly = errors.New("exactlyonce: no transaction and no outbox: the lease store (Config.Lease.Store) is not PostgreSQL")

// storeOnlyUse records that a handler under a store-only lease asked for
// what the store cannot give.
type storeOnlyUse struct{ asked atomic.Bool }

// tx returns the handler's transaction, beginning it in lease mode.
func tx(ctx context.Context, helper string) (wsql.Tx, error) {
	v := valuesFrom(ctx)
	switch {
	case v == nil:
		return nil, noDelivery(ctx, helper)
	case v.failOpen:
		return nil, errFailOpen
	case v.storeOnly != nil:
		v.storeOnly.asked.Store(true)
		return nil, errStoreOnly
	}
	t, err := v.tx.get()
	if err != nil {
		return nil, fmt.Errorf("exactlyonce: the handler's transaction: %w", err)
	}
	return t, nil
}

// PgxTxFromContext returns the transaction the middleware opened for this
// message, when Config.DB.Conn is pgx (wsql.BeginnerFromPgx). Do the
// handler's writes through it; do not commit or roll it back: the
// middleware does. In lease mode it begins on the first call, so that a
// handler holds no connection while it waits for an external provider.
//
// It returns an error wrapping ErrNoMiddleware outside a handler under the
// middleware (which IsPermanent reports: see ErrNoMiddleware), in a
// fail-open run (no database), when the driver is database/sql, when
// the transaction cannot begin, or in lease mode with a store that is not
// PostgreSQL (LeaseConfig.Store: there is no transaction; asking for one
// is a configuration error: the key is parked, and the handler's later
// messages are refused before the handler runs). Return it.
func PgxTxFromContext(ctx context.Context) (pgx.Tx, error) {
	t, err := tx(ctx, "PgxTxFromContext")
	if err != nil {
		return nil, err
	}
	if p, ok := pgxOf(t); ok {
		return p, nil
	}
	return nil, fmt.Errorf("exactlyonce: PgxTxFromContext: Config.DB.Conn is not pgx (it is %T): use StdTxFromContext", t)
}

// StdTxFromContext is PgxTxFromContext for database/sql
// (wsql.BeginnerFromStdSQL): the message's transaction as a *sql.Tx.
func StdTxFromContext(ctx context.Context) (*stdsql.Tx, error) {
	t, err := tx(ctx, "StdTxFromContext")
	if err != nil {
		return nil, err
	}
	if std, ok := sqlexec.TxOf(t).StdTx(); ok {
		return std, nil
	}
	return nil, fmt.Errorf("exactlyonce: StdTxFromContext: Config.DB.Conn is not database/sql (it is %T): use PgxTxFromContext", t)
}

// OutboxFromContext returns a publisher that writes to the outbox within the
// handler's transaction: the relay publishes what it wrote after the
// commit. Returning messages from the handler does the same for the
// handler's publish topic; use this to publish to other topics, or
// SetDestination. It returns an error where PgxTxFromContext does.
func OutboxFromContext(ctx context.Context) (message.Publisher, error) {
	v := valuesFrom(ctx)
	switch {
	case v == nil:
		return nil, noDelivery(ctx, "OutboxFromContext")
	case v.failOpen:
		return nil, errFailOpen
	case v.storeOnly != nil:
		v.storeOnly.asked.Store(true)
		return nil, errStoreOnly
	}
	return v.outbox, nil
}

// Exec runs a write in the handler's transaction, for handlers that do not
// need its result (an INSERT, an UPDATE). With group commit (Config.Batch)
// and pgx it defers the statement: the statements every handler of the
// batch gave Exec are sent in one round trip (a pgx batch) after the last
// handler ran and before the COMMIT, and Exec returns nil at once; do not
// read in the handler what it wrote with Exec then: it has not run yet. A
// deferred statement that fails fails its message as if the handler had
// returned the error (the rest of the batch runs again without it).
// Otherwise Exec runs the statement at once, as ExecContext on the
// transaction does, and returns its error. Exec returns an error where
// PgxTxFromContext does.
func Exec(ctx context.Context, query string, args ...any) error {
	v := valuesFrom(ctx)
	switch {
	case v == nil:
		return noDelivery(ctx, "Exec")
	case v.failOpen:
		return errFailOpen
	case v.queue != nil:
		*v.queue = append(*v.queue, queuedStmt{query: query, args: args})
		return nil
	}
	t, err := tx(ctx, "Exec")
	if err != nil {
		return err
	}
	_, err = t.ExecContext(ctx, query, args...)
	return err
}

// Info is what a handler knows about its delivery.
type Info struct {
	// Consumer is the name the key is recorded under.
	Consumer string
	// Key is the message key the middleware deduplicates on.
	Key string
	// IdempotencyKey is the key to pass to an external provider (for
	// example as the Idempotency-Key HTTP header): at most 255 bytes, the
	// same for every attempt of one (consumer, key), and different for
	// every other (consumer, key). For a consumer that contains no ':' and
	// is not "sha256" (nearly all) it is "<consumer>:<key>", or
	// "sha256:<hex>" (the SHA-256 of consumer, a NUL byte and key) when that
	// would be longer than 255 bytes. For any other consumer it is
	// ":<len(consumer)>:<consumer>:<key>" (the length in bytes, in decimal),
	// or ":sha256:<hex>" (the SHA-256 of that string) when longer than 255
	// bytes. The leading ':' and the length keep the two forms and the
	// consumer's end apart: "notify" with key "vip:42" gets
	// "notify:vip:42", "notify:vip" with key "42" gets ":10:notify:vip:42".
	IdempotencyKey string
	// Attempt is 1 for the first run of the key in lease mode, and counts
	// up; 0 in transactional mode.
	Attempt int
	// Interrupted is true in lease mode when the previous attempt's lease
	// expired while it was processing, or its completion failed after the
	// handler ran: its call to the provider may or may not have happened.
	// Pass the same IdempotencyKey and the provider can tell.
	Interrupted bool
	// LeaseUntil is when the lease ends unless extended (lease mode).
	LeaseUntil time.Time
	// FailOpen is true in a fail-open run: no deduplication, no
	// transaction.
	FailOpen bool
}

// InfoFromContext returns the delivery's Info; an error outside a handler
// under the middleware.
func InfoFromContext(ctx context.Context) (Info, error) {
	v := valuesFrom(ctx)
	if v == nil {
		return Info{}, noDelivery(ctx, "InfoFromContext")
	}
	info := Info{Consumer: v.consumer, Key: v.key, IdempotencyKey: idempotencyKey(v.consumer, v.key), FailOpen: v.failOpen}
	if v.lease != nil {
		l := v.lease.snapshot()
		info.Attempt, info.Interrupted, info.LeaseUntil = l.attempt, l.interrupted, l.leaseUntil
	}
	return info, nil
}

// txHandle is the handler's transaction: begun up front (transactional
// mode) or on first use (lease mode). The handler may read it from several
// goroutines.
type txHandle struct {
	mu    sync.Mutex
	begin func() (wsql.Tx, error)
	tx    wsql.Tx
	err   error
	ended bool
}

func readyTx(tx wsql.Tx) *txHandle { return &txHandle{tx: tx} }

func lazyTx(begin func() (wsql.Tx, error)) *txHandle { return &txHandle{begin: begin} }

// get returns the transaction, beginning it if needed.
func (h *txHandle) get() (wsql.Tx, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.tx == nil && h.err == nil && h.begin != nil && !h.ended {
		// watermill-sql's adapters return a non-nil wrapper around a nil
		// transaction with their error: keep only the error.
		if tx, err := h.begin(); err != nil {
			h.err = err
		} else {
			h.tx = tx
		}
	}
	if h.ended && h.err == nil {
		return nil, errors.New("exactlyonce: the handler's transaction has ended")
	}
	return h.tx, h.err
}

// current returns the transaction if it was begun and has not ended,
// without beginning it.
func (h *txHandle) current() (wsql.Tx, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.tx == nil || h.ended {
		return nil, false
	}
	return h.tx, true
}

// beginErr returns the error of a failed begin, if any.
func (h *txHandle) beginErr() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.err
}

// rollback rolls the transaction back if it was begun and not ended.
func (h *txHandle) rollback() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.tx != nil && !h.ended {
		_ = h.tx.Rollback()
	}
	h.ended = true
}

// commit commits the transaction (which must have been begun).
func (h *txHandle) commit() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.ended = true
	return h.tx.Commit()
}
