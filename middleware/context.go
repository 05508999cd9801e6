package middleware

import (
	"context"
	stdsql "database/sql"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
)

type ctxKey struct{}

// handlerValues is what the middleware puts in the handler's context, under
// one key (one allocation instead of one per value).
type handlerValues struct {
	tx       wsql.Tx
	outbox   message.Publisher
	consumer string
	key      string
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
func TxFromContext(ctx context.Context) (wsql.Tx, bool) {
	if v := valuesFrom(ctx); v != nil && v.tx != nil {
		return v.tx, true
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
