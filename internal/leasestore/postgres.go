package leasestore

import (
	"context"
	"errors"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
)

// Postgres is the inbox table as a Backend: the store lease mode uses
// unless another is configured. Despite its name it serves both SQL
// dialects: Store's (inboxdb.Config.Tables.Dialect) picks PostgreSQL's or
// MySQL/MariaDB's statements, with the same outcomes, and pgerr classifies
// either's errors. Its completion is a transaction of DB that also holds
// the handler's writes and output messages.
type Postgres struct {
	Store *inboxdb.Store
	DB    wsql.Beginner
}

var _ Backend = (*Postgres)(nil)

// Claim runs inboxdb's ClaimLease (its own short transaction).
func (p *Postgres) Claim(ctx context.Context, consumer, key string, opts Options) (Claim, error) {
	return p.Store.ClaimLease(ctx, p.DB, consumer, key, opts)
}

// exec is the attempt's transaction when it began, else the pool.
func (p *Postgres) exec(a Attempt) wsql.ContextExecutor {
	if a.Tx != nil {
		return a.Tx
	}
	return p.DB
}

// Extend writes in a.Tx when set (its row lock keeps other workers off the
// key until the transaction ends), else commits at once.
func (p *Postgres) Extend(ctx context.Context, a Attempt, d time.Duration) (time.Time, error) {
	return p.Store.ExtendLease(ctx, p.exec(a), a.Consumer, a.Key, a.Token, d)
}

// Complete writes the done record in a.Tx, which is required: the caller
// commits it with the handler's writes.
func (p *Postgres) Complete(ctx context.Context, a Attempt) error {
	if a.Tx == nil {
		return errors.New("the SQL lease store completes in the handler's transaction, and none was given")
	}
	return p.Store.CompleteTx(ctx, a.Tx, a.Consumer, a.Key, a.Token)
}

// Owns checks in a fresh statement (never in a.Tx).
func (p *Postgres) Owns(ctx context.Context, a Attempt) (bool, error) {
	return p.Store.Owns(ctx, p.DB, a.Consumer, a.Key, a.Token)
}

// Fail commits at once.
func (p *Postgres) Fail(ctx context.Context, a Attempt, errText string, permanent bool) error {
	return p.Store.Fail(ctx, p.DB, a.inboxdb(), errText, permanent)
}

// ParkInterrupted commits at once.
func (p *Postgres) ParkInterrupted(ctx context.Context, a Attempt, reason string) error {
	return p.Store.ParkInterrupted(ctx, p.DB, a.inboxdb(), reason)
}

// inboxdb is a as inboxdb's Fail and ParkInterrupted take it.
func (a Attempt) inboxdb() inboxdb.Attempt {
	return inboxdb.Attempt{Consumer: a.Consumer, Key: a.Key, Token: a.Token, Message: a.Message}
}

// Get looks the record up.
func (p *Postgres) Get(ctx context.Context, consumer, key string) (Record, error) {
	return p.Store.Lookup(ctx, p.DB, consumer, key)
}

// Forget deletes the record and the message its park kept.
func (p *Postgres) Forget(ctx context.Context, consumer, key string) (bool, error) {
	return p.Store.Forget(ctx, p.DB, consumer, key)
}

// Parked lists parked records (every consumer when consumer is empty).
func (p *Postgres) Parked(ctx context.Context, consumer string, limit int) ([]Record, error) {
	return p.Store.ListParked(ctx, p.DB, consumer, limit)
}

// Release turns a parked record into failed.
func (p *Postgres) Release(ctx context.Context, consumer, key string) (bool, error) {
	return p.Store.Release(ctx, p.DB, consumer, key)
}

// Unreachable is pgerr.Unreachable (PostgreSQL's and MySQL's errors).
func (p *Postgres) Unreachable(err error) bool { return pgerr.Unreachable(err) }

// Transactional is true: the completion is a transaction of the SQL
// database.
func (p *Postgres) Transactional() bool { return true }
