package outboxwrite

import (
	"time"
)

// Wake-on-commit, the writers' side (PostgreSQL's: MySQL has no NOTIFY,
// and its writers send nothing). A transaction that writes outbox rows
// also sends a PostgreSQL NOTIFY on the table's channel, which PostgreSQL
// delivers when (and only if) the transaction commits; a Relay LISTENs on a
// connection of its own and relays at once instead of waiting out its
// PollInterval (package outbox's notify.go has the relay's side).
//
// NOTIFY is not free: PostgreSQL serialises the commits of the transactions
// that sent one (a database-wide lock from the notification's queueing to the
// end of the commit, WAL flush included). Measured with pgbench, 8 clients
// of one-row transactions: 4,200 tps without, 2,700 tps with a NOTIFY in each.
// So the writers of a Writer debounce: a transaction sends it only when no
// transaction of the Writer sent one in the last NotifyDebounce, which
// bounds the notifying commits to 100/s per Writer. A transaction that
// skipped it is covered by the Relay's catch-up polls.
//
// When the debounce is decided matters. The transactions of the
// middleware decide it right before their commit (Writer.AtCommit: a
// separate statement, sent at most once per NotifyDebounce), so a
// transaction that skips relies on one that commits at the same moment. A
// Publisher in the application's own transaction cannot know when that
// commits: it decides at its INSERT, with no extra round trip. Its NOTIFY
// is then only as early as its commit: a transaction that wrote its rows
// and goes on for long, or rolls back, leaves the rows other writers of the
// Writer committed in the next NotifyDebounce waiting for its commit, or
// for the poll.

// NotifyDebounce is the shortest interval between two NOTIFYs of a Writer's
// transactions.
const NotifyDebounce = 10 * time.Millisecond

// shouldNotify reports whether a writer should send a NOTIFY now, and if so
// records it: at most one caller per NotifyDebounce gets true. The function
// returned (when true) takes the record back, for a NOTIFY that did not go
// out after all (its statement failed), so that the next writer sends one.
func (w *Writer) shouldNotify(now time.Time) (bool, func()) {
	last := w.last.Load()
	t := now.UnixNano()
	if t-last < int64(NotifyDebounce) {
		return false, nil
	}
	if !w.last.CompareAndSwap(last, t) {
		return false, nil
	}
	return true, func() { w.last.CompareAndSwap(t, last) }
}
