package middleware

import (
	"context"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
)

// pgxPool returns the pool behind db when db is sql.BeginnerFromPgx(pool):
// then the middleware begins and claims in one round trip
// (inbox.Store.BeginClaimPgx) instead of two.
func pgxPool(db wsql.Beginner) (*pgxpool.Pool, bool) {
	var conn wsql.Conn
	switch b := db.(type) {
	case wsql.PgxBeginner:
		conn = b.Conn
	case *wsql.PgxBeginner:
		conn = b.Conn
	default:
		return nil, false
	}
	pool, ok := conn.(*pgxpool.Pool)
	return pool, ok && pool != nil
}

// pooledTx is a pgx transaction on a connection acquired from a pool; it
// releases the connection when it ends. It implements watermill-sql's Tx.
type pooledTx struct {
	tx   pgx.Tx
	conn *pgxpool.Conn
	ctx  context.Context
}

var _ wsql.Tx = (*pooledTx)(nil)

func (t *pooledTx) ExecContext(ctx context.Context, query string, args ...any) (wsql.Result, error) {
	tag, err := t.tx.Exec(ctx, query, args...)
	return wsql.PgxResult{CommandTag: tag}, err
}

func (t *pooledTx) QueryContext(ctx context.Context, query string, args ...any) (wsql.Rows, error) {
	rows, err := t.tx.Query(ctx, query, args...)
	return wsql.PgxRows{Rows: rows}, err
}

func (t *pooledTx) Commit() error {
	defer t.release()
	return t.tx.Commit(t.ctx)
}

func (t *pooledTx) Rollback() error {
	defer t.release()
	return t.tx.Rollback(context.WithoutCancel(t.ctx))
}

func (t *pooledTx) release() {
	if t.conn != nil {
		t.conn.Release()
		t.conn = nil
	}
}

// beginClaimPgx acquires a connection and begins + claims in one round
// trip. A nil tx with a nil error means a duplicate.
func (m *Middleware) beginClaimPgx(ctx context.Context, pool *pgxpool.Pool, consumer, key string) (*pooledTx, inbox.ClaimResult, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, inbox.ClaimResult{}, err
	}
	tx, claim, err := m.store.BeginClaimPgx(ctx, conn.Conn(), consumer, key)
	if err != nil || !claim.Claimed {
		conn.Release()
		return nil, claim, err
	}
	return &pooledTx{tx: tx, conn: conn, ctx: ctx}, claim, nil
}
