package middleware

import (
	"context"
	stdsql "database/sql"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
)

type ctxKey int

const (
	txKey ctxKey = iota
	outboxKey
	messageKeyKey
	consumerKey
)

func withHandlerContext(ctx context.Context, tx wsql.Tx, ob message.Publisher, consumer, key string) context.Context {
	ctx = context.WithValue(ctx, txKey, tx)
	ctx = context.WithValue(ctx, outboxKey, ob)
	ctx = context.WithValue(ctx, consumerKey, consumer)
	return context.WithValue(ctx, messageKeyKey, key)
}

// TxFromContext returns the transaction the middleware opened for this
// message, as watermill-sql's seam type. Prefer PgxTxFromContext or
// StdTxFromContext for the driver's own type. Do not commit or roll it back:
// the middleware does.
func TxFromContext(ctx context.Context) (wsql.Tx, bool) {
	tx, ok := ctx.Value(txKey).(wsql.Tx)
	return tx, ok && tx != nil
}

// PgxTxFromContext returns the handler's transaction as a pgx.Tx when the
// middleware's DB is pgx (sql.BeginnerFromPgx).
func PgxTxFromContext(ctx context.Context) (pgx.Tx, bool) {
	tx, _ := TxFromContext(ctx)
	switch t := tx.(type) {
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
	p, ok := ctx.Value(outboxKey).(message.Publisher)
	return p, ok && p != nil
}

// KeyFromContext returns the message key the middleware deduplicates on.
func KeyFromContext(ctx context.Context) string {
	s, _ := ctx.Value(messageKeyKey).(string)
	return s
}

// ConsumerFromContext returns the consumer name the key is recorded under.
func ConsumerFromContext(ctx context.Context) string {
	s, _ := ctx.Value(consumerKey).(string)
	return s
}
