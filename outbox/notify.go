package outbox

import (
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Wake-on-commit. A transaction that writes outbox rows also sends a
// PostgreSQL NOTIFY on the table's channel, which PostgreSQL delivers when
// (and only if) the transaction commits; a Relay LISTENs on a connection of
// its own and relays at once instead of waiting out its PollInterval.
//
// NOTIFY is not free: PostgreSQL serialises the commits of the transactions
// that sent one (a database-wide lock from the notification's queueing to the
// end of the commit, WAL flush included). Measured with pgbench, 8 clients
// of one-row transactions: 4,200 tps without, 2,700 tps with a NOTIFY in each.
// So the writers of a process debounce: a transaction sends it only when no
// transaction of this process sent one for this table in the last
// notifyDebounce, which bounds the notifying commits to 100/s per process and
// table. A transaction that skipped it is covered by the Relay's catch-up:
// after a pass that relayed rows, the Relay polls every catchUpPoll until
// catchUpWindow passes without a row, so a row committed shortly after a
// notified one leaves within catchUpPoll. A row committed later than that
// without a NOTIFY of its own waits for the PollInterval poll, as it would
// without wake-on-commit: polling stays the fallback and the bound.
//
// When the debounce is decided matters. The transactions of the
// middleware decide it right before their commit (outboxnotify.AtCommit: a
// separate statement, sent at most once per notifyDebounce), so a
// transaction that skips relies on one that commits at the same moment. A
// Publisher in the application's own transaction cannot know when that
// commits: it decides at its INSERT, with no extra round trip. Its NOTIFY
// is then only as early as its commit: a transaction that wrote its rows
// and goes on for long, or rolls back, leaves the rows other writers of the
// process committed in the next notifyDebounce waiting for its commit, or
// for the poll.
const (
	notifyDebounce = 10 * time.Millisecond
	catchUpWindow  = 40 * time.Millisecond
	catchUpPoll    = 2 * time.Millisecond
)

// channelName is the NOTIFY channel of db's outbox table
// (outboxnotify.Channel: the console reads it too).
func channelName(db sqlschema.DB) string { return outboxnotify.Channel(db) }

// notifyGates holds, per channel and database, the time of the latest
// NOTIFY a writer of this process sent (unix nanoseconds).
var notifyGates sync.Map // gateKey -> *atomic.Int64

// gateKey tells the debounces apart: one table name in two databases (a
// database per tenant or shard) has two relays, and a NOTIFY sent to one
// wakes nothing in the other. A database is known by its sqlschema.DB.Conn;
// writers given none (or one that cannot be compared) share the table
// name's.
type gateKey struct {
	channel string
	conn    any
}

func notifyGate(db sqlschema.DB, channel string) *atomic.Int64 {
	key := gateKey{channel: channel}
	if db.Conn != nil && reflect.ValueOf(db.Conn).Comparable() {
		key.conn = db.Conn
	}
	if g, ok := notifyGates.Load(key); ok {
		return g.(*atomic.Int64)
	}
	g, _ := notifyGates.LoadOrStore(key, new(atomic.Int64))
	return g.(*atomic.Int64)
}

// shouldNotify reports whether a writer should send a NOTIFY now, and if so
// records it: at most one caller per notifyDebounce gets true. The function
// returned (when true) takes the record back, for a NOTIFY that did not go
// out after all (its statement failed), so that the next writer sends one.
func shouldNotify(gate *atomic.Int64, now time.Time) (bool, func()) {
	last := gate.Load()
	t := now.UnixNano()
	if t-last < int64(notifyDebounce) {
		return false, nil
	}
	if !gate.CompareAndSwap(last, t) {
		return false, nil
	}
	return true, func() { gate.CompareAndSwap(t, last) }
}

// withNotify wraps an INSERT so that the same statement also sends the
// NOTIFY: no extra round trip. A data-modifying WITH runs to completion
// whether or not the outer query reads it.
func withNotify(insert, channel string) string {
	return "WITH ins AS (" + insert + ") SELECT pg_notify(" + quoteLiteral(channel) + ", '')"
}

// quoteLiteral quotes s as an SQL string literal.
func quoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}
