package middleware

import (
	"context"
	stdsql "database/sql"
	"errors"
	"sync"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
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
}

func withHandlerContext(ctx context.Context, v *handlerValues) context.Context {
	return context.WithValue(ctx, ctxKey{}, v)
}

func valuesFrom(ctx context.Context) *handlerValues {
	v, _ := ctx.Value(ctxKey{}).(*handlerValues)
	return v
}

// TxFromContext returns the transaction the middleware opened for this
// message, as watermill-sql's seam type. Prefer PgxTxFromContext or
// StdTxFromContext for the driver's own type. Do not commit or roll it back:
// the middleware does.
//
// In lease mode the transaction begins on the first call, so that a handler
// holds no database connection while it waits for an external provider
// before its first write; if it cannot begin, TxFromContext returns false
// and the attempt fails with the database error.
func TxFromContext(ctx context.Context) (wsql.Tx, bool) {
	if v := valuesFrom(ctx); v != nil && v.tx != nil {
		tx, err := v.tx.get()
		return tx, err == nil && tx != nil
	}
	return nil, false
}

// PgxTxFromContext returns the handler's transaction as a pgx.Tx when the
// middleware's DB is pgx (sql.BeginnerFromPgx).
func PgxTxFromContext(ctx context.Context) (pgx.Tx, bool) {
	tx, _ := TxFromContext(ctx)
	switch t := tx.(type) {
	case *pooledTx:
		return t.tx, t.tx != nil
	case *wsql.PgxTx:
		return t.Tx, t.Tx != nil
	case wsql.PgxTx:
		return t.Tx, t.Tx != nil
	}
	return nil, false
}

// StdTxFromContext returns the handler's transaction as a *sql.Tx when the
// middleware's DB is database/sql (sql.BeginnerFromStdSQL).
func StdTxFromContext(ctx context.Context) (*stdsql.Tx, bool) {
	tx, _ := TxFromContext(ctx)
	switch t := tx.(type) {
	case *wsql.StdSQLTx:
		return t.Tx, t.Tx != nil
	case wsql.StdSQLTx:
		return t.Tx, t.Tx != nil
	}
	return nil, false
}

// OutboxFromContext returns a publisher that writes to the outbox within the
// handler's transaction. Returning messages from the handler does the same
// for the handler's publish topic; use this to publish to other topics.
func OutboxFromContext(ctx context.Context) (message.Publisher, bool) {
	if v := valuesFrom(ctx); v != nil && v.outbox != nil {
		return v.outbox, true
	}
	return nil, false
}

// KeyFromContext returns the message key the middleware deduplicates on.
func KeyFromContext(ctx context.Context) string {
	if v := valuesFrom(ctx); v != nil {
		return v.key
	}
	return ""
}

// ConsumerFromContext returns the consumer name the key is recorded under.
func ConsumerFromContext(ctx context.Context) string {
	if v := valuesFrom(ctx); v != nil {
		return v.consumer
	}
	return ""
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
