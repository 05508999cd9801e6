package outbox

import (
	"context"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

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
func SelectSQL(r *Relay) string { return r.selectSQL }

// FindSQL is the query of FindRows for f: up to limit rows with ids above
// after, and its arguments.
func FindSQL(db sqlschema.DB, f RowFilter, after int64, limit int) (string, []any) {
	return findSQL(db, f, after, limit)
}

// CountSQL is the query of CountRows for f, and its arguments.
func CountSQL(db sqlschema.DB, f RowFilter) (string, []any) { return countSQL(db, f) }

// MatchingBatch is how many rows RequeueMatching and DiscardMatching change
// per statement.
const MatchingBatch = matchingBatch

// LockClass is the first value of the advisory locks of db's ordering keys.
func LockClass(db sqlschema.DB) int32 { return outboxwrite.LockClass(db.Outbox()) }

// PlainSQL is the batch statement of a table without keyed rows ($1 batch
// size, $2 the most retried rows, $3 the paused topics).
func PlainSQL(r *Relay) string { return r.plainSQL }

// HasKeyedRows runs the relay's probe in tx.
func HasKeyedRows(ctx context.Context, r *Relay, tx wsql.Tx) (bool, error) {
	return r.hasKeyedRows(ctx, tx)
}
