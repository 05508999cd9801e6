package outbox

import (
	"context"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxwrite"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// ChannelName exposes channelName to the tests of package outbox_test.
var ChannelName = channelName

// SetListenPing sets r's LISTEN connection's ping interval and timeout;
// call it before r.Run.
func SetListenPing(r *Relay, every, timeout time.Duration) {
	r.listenPing, r.listenPingTimeout = every, timeout
}

// SelectSQL is the statement that locks a relay's batch ($1 batch size, $2
// the most retried rows, $3 the paused topics, $4 the window of rows the
// heads of keys are looked for among).
func SelectSQL(r *Relay) string { return statement(r.store, "ClaimKeyed") }

// statement is the statement called name of st.
func statement(st *outboxdb.Store, name string) string {
	for _, s := range st.Statements() {
		if s.Name == name {
			return s.SQL
		}
	}
	panic("no statement " + name)
}

// FindSQL is the query of Store.Find for f: up to limit rows with ids
// above after, and its arguments.
func FindSQL(db sqlschema.DB, f RowFilter, after int64, limit int) (string, []any) {
	st, err := outboxdb.New(db)
	if err != nil {
		panic(err)
	}
	return st.FindRowsQuery(f.internal(), after, limit)
}

// CountSQL is the query of Store.Count for f, and its arguments.
func CountSQL(db sqlschema.DB, f RowFilter) (string, []any) {
	st, err := outboxdb.New(db)
	if err != nil {
		panic(err)
	}
	return st.CountRowsQuery(f.internal(), f.countBound())
}

// MatchingBatch is how many rows Store.RequeueMatching and DiscardMatching change
// per statement.
const MatchingBatch = matchingBatch

// LockClass is the first value of the advisory locks of db's ordering keys.
func LockClass(db sqlschema.DB) int32 { return outboxwrite.LockClass(db.Outbox()) }

// PlainSQL is the batch statement of a table without keyed rows ($1 batch
// size, $2 the most retried rows, $3 the paused topics).
func PlainSQL(r *Relay) string { return statement(r.store, "ClaimPlain") }

// HasKeyedRows runs the relay's probe in tx.
func HasKeyedRows(ctx context.Context, r *Relay, tx wsql.Tx) (bool, error) {
	return r.store.Probe(ctx, tx)
}

// ListenConnReceives opens r's LISTEN connection as Run does, LISTENs on
// channel, has notify send a NOTIFY on it, and reports whether that
// connection's own WaitForNotification returned the notification.
func ListenConnReceives(ctx context.Context, r *Relay, channel string, notify func() error) (bool, error) {
	var got bool
	err := r.withListenConn(ctx, func(conn *pgx.Conn) error {
		if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
			return err
		}
		if err := notify(); err != nil {
			return err
		}
		wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		n, err := conn.WaitForNotification(wctx)
		if err != nil {
			return err
		}
		got = n != nil && n.Channel == channel
		return nil
	})
	return got, err
}
