package testenv

import (
	"context"
	"errors"
	"sync/atomic"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Counters counts the middleware's events by what happened; its Observe
// method fits Config.OnEvent. The nacked deliveries are split by cause
// (the sentinel the error wraps): Rejected (ErrInvalidKey), DBUnavailable,
// ClaimFailed, Busy (ErrLeaseHeld), and Failed for every other one
// (handler errors and panics, lost leases, failed commits, bad outputs).
type Counters struct {
	Processed, Duplicates, Failed, Rejected, DBUnavailable, FailOpen, Busy, Parked, ClaimFailed, Interrupted atomic.Int64
}

// Observe counts e.
func (c *Counters) Observe(e exactlyonce.Event) {
	switch e.Outcome {
	case exactlyonce.Processed:
		c.Processed.Add(1)
	case exactlyonce.Duplicate:
		c.Duplicates.Add(1)
	case exactlyonce.Parked:
		c.Parked.Add(1)
	case exactlyonce.FailOpen:
		c.FailOpen.Add(1)
	case exactlyonce.Nacked:
		switch {
		case errors.Is(e.Err, exactlyonce.ErrInvalidKey):
			c.Rejected.Add(1)
		case errors.Is(e.Err, exactlyonce.ErrDBUnavailable) && !errors.Is(e.Err, exactlyonce.ErrLeaseLost) && e.Attempt == 0:
			c.DBUnavailable.Add(1)
		case errors.Is(e.Err, exactlyonce.ErrClaimFailed):
			c.ClaimFailed.Add(1)
		case errors.Is(e.Err, exactlyonce.ErrLeaseHeld):
			c.Busy.Add(1)
		default:
			c.Failed.Add(1)
		}
	}
	if e.Interrupted {
		c.Interrupted.Add(1)
	}
}

// Exec runs a statement in the handler's transaction, whichever driver the
// middleware uses (pgx or database/sql): the "write through whichever
// driver's transaction" helper of every test.
func Exec(ctx context.Context, query string, args ...any) error {
	if tx, err := exactlyonce.PgxTxFromContext(ctx); err == nil {
		_, err = tx.Exec(ctx, query, args...)
		return err
	}
	tx, err := exactlyonce.StdTxFromContext(ctx)
	if err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, query, args...)
	return err
}

// WithConn returns db with its Conn replaced: the same tables through
// another driver (see Drivers).
func WithConn(db sqlschema.DB, conn wsql.Beginner) sqlschema.DB {
	db.Conn = conn
	return db
}
