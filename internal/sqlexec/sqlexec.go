// Package sqlexec is the library's typed executor: the user's
// watermill-sql Beginner, or a transaction the user passed in, classified
// once into a value that knows which driver is behind it.
//
// The public seam stays watermill-sql's: users pass wsql.BeginnerFromPgx(pool),
// wsql.BeginnerFromStdSQL(db) or any wsql.Beginner, and their own wsql.Tx.
// What needs the driver (the pgx fast path of the claim, a pgx batch, the
// relay's LISTEN connection, the handler's PgxTxFromContext or
// StdTxFromContext) asks the classified value, never the Beginner by a type
// switch of its own: the only switches on driver types in the library are
// Of (a Beginner) and TxOf (a Tx), here.
package sqlexec

import (
	"context"
	stdsql "database/sql"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Kind is the driver behind a Beginner or a Tx.
type Kind uint8

const (
	// Other is any other implementation of watermill-sql's seam: only its
	// interface is used.
	Other Kind = iota
	// Pgx is pgx/v5 (a pool, a connection, or their transaction).
	Pgx
	// Std is database/sql.
	Std
)

// String names the kind.
func (k Kind) String() string {
	switch k {
	case Pgx:
		return "pgx"
	case Std:
		return "database/sql"
	}
	return "other"
}

// DB is a Beginner classified once: it is the Beginner, and knows the pgx
// pool or *sql.DB behind it when there is one.
type DB struct {
	wsql.Beginner
	kind Kind
	pool *pgxpool.Pool
	std  *stdsql.DB
}

// Of classifies b: wsql.BeginnerFromPgx of a *pgxpool.Pool (Kind Pgx,
// PgxPool), of another pgx connection (Kind Pgx, no pool),
// wsql.BeginnerFromStdSQL of a *sql.DB (Kind Std, StdDB), of another
// database/sql beginner (Kind Std), or anything else (Other). A nil b is
// Other with a nil Beginner.
func Of(b wsql.Beginner) DB {
	d := DB{Beginner: b}
	switch v := b.(type) {
	case wsql.PgxBeginner:
		d.kind = Pgx
		d.pool, _ = v.Conn.(*pgxpool.Pool)
	case *wsql.PgxBeginner:
		if v != nil {
			d.kind = Pgx
			d.pool, _ = v.Conn.(*pgxpool.Pool)
		}
	case wsql.StdSQLBeginner:
		d.kind = Std
		d.std, _ = v.SQLBeginner.(*stdsql.DB)
	case *wsql.StdSQLBeginner:
		if v != nil {
			d.kind = Std
			d.std, _ = v.SQLBeginner.(*stdsql.DB)
		}
	}
	return d
}

// OfStd is Of(wsql.BeginnerFromStdSQL(db)): a *sql.DB is not a
// wsql.Beginner itself.
func OfStd(db *stdsql.DB) DB { return Of(wsql.BeginnerFromStdSQL(db)) }

// Kind is the driver behind the Beginner.
func (d DB) Kind() Kind { return d.kind }

// PgxPool returns the pgx pool behind the Beginner, when it is
// wsql.BeginnerFromPgx(pool).
func (d DB) PgxPool() (*pgxpool.Pool, bool) { return d.pool, d.pool != nil }

// StdDB returns the *sql.DB behind the Beginner, when it is
// wsql.BeginnerFromStdSQL(db).
func (d DB) StdDB() (*stdsql.DB, bool) { return d.std, d.std != nil }

// Begin begins a transaction through the Beginner and classifies it.
func (d DB) Begin(ctx context.Context, opts *stdsql.TxOptions) (Tx, error) {
	t, err := d.BeginTx(ctx, opts)
	if err != nil {
		return Tx{}, err
	}
	return TxOf(t), nil
}

// Tx is a transaction classified once: it is the watermill-sql Tx the
// user receives, and knows the pgx.Tx or *sql.Tx behind it.
type Tx struct {
	wsql.Tx
	kind Kind
	pgx  pgx.Tx
	std  *stdsql.Tx
}

// TxOf classifies t: wsql.TxFromPgx's, a *PoolTx (Kind Pgx, Pgx),
// wsql.TxFromStdSQL's (Kind Std, StdTx), or anything else (Other). A Tx
// passes through.
func TxOf(t wsql.Tx) Tx {
	x := Tx{Tx: t}
	switch v := t.(type) {
	case Tx:
		return v
	case *Tx:
		if v != nil {
			return *v
		}
	case *PoolTx:
		if v != nil && v.tx != nil {
			x.kind, x.pgx = Pgx, v.tx
		}
	case wsql.PgxTx:
		if v.Tx != nil {
			x.kind, x.pgx = Pgx, v.Tx
		}
	case *wsql.PgxTx:
		if v != nil && v.Tx != nil {
			x.kind, x.pgx = Pgx, v.Tx
		}
	case wsql.StdSQLTx:
		if v.Tx != nil {
			x.kind, x.std = Std, v.Tx
		}
	case *wsql.StdSQLTx:
		if v != nil && v.Tx != nil {
			x.kind, x.std = Std, v.Tx
		}
	}
	return x
}

// Kind is the driver behind the transaction.
func (t Tx) Kind() Kind { return t.kind }

// Pgx returns the pgx transaction behind t, when there is one.
func (t Tx) Pgx() (pgx.Tx, bool) { return t.pgx, t.pgx != nil }

// StdTx returns the database/sql transaction behind t, when there is one.
func (t Tx) StdTx() (*stdsql.Tx, bool) { return t.std, t.std != nil }

// PoolTx is a pgx transaction on a connection acquired from a pool; it
// releases the connection when it ends. It implements watermill-sql's Tx
// (TxOf classifies it as Pgx).
type PoolTx struct {
	tx   pgx.Tx
	conn *pgxpool.Conn
	ctx  context.Context
}

var _ wsql.Tx = (*PoolTx)(nil)

// NewPoolTx is tx, begun on conn (acquired from a pool), as a wsql.Tx that
// releases conn when it ends. ctx is the context its Commit uses.
func NewPoolTx(ctx context.Context, tx pgx.Tx, conn *pgxpool.Conn) *PoolTx {
	return &PoolTx{tx: tx, conn: conn, ctx: ctx}
}

// ExecContext implements wsql.ContextExecutor.
func (t *PoolTx) ExecContext(ctx context.Context, query string, args ...any) (wsql.Result, error) {
	tag, err := t.tx.Exec(ctx, query, args...)
	return wsql.PgxResult{CommandTag: tag}, err
}

// QueryContext implements wsql.ContextExecutor.
func (t *PoolTx) QueryContext(ctx context.Context, query string, args ...any) (wsql.Rows, error) {
	rows, err := t.tx.Query(ctx, query, args...)
	return wsql.PgxRows{Rows: rows}, err
}

// Commit commits and releases the connection.
func (t *PoolTx) Commit() error {
	defer t.release()
	return t.tx.Commit(t.ctx)
}

// Rollback rolls back and releases the connection.
func (t *PoolTx) Rollback() error {
	defer t.release()
	return t.tx.Rollback(context.WithoutCancel(t.ctx))
}

func (t *PoolTx) release() {
	if t.conn != nil {
		t.conn.Release()
		t.conn = nil
	}
}

// Pgx returns the pgx transaction.
func (t *PoolTx) Pgx() pgx.Tx { return t.tx }
