package outboxwrite

import "github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"

// committed is called after a transaction that Publish began and committed
// itself (a Publisher bound to a pool or a *sql.DB) wrote rows. On MySQL,
// which has no NOTIFY, it is where the relays of this process are to be
// woken in-process (the relay's side owns that registry); transactions
// whose commit is the caller's are signalled by the caller after it
// commits (Committed). On PostgreSQL the transaction's NOTIFY did it.
func (w *Writer) committed() {
	if w.mysql {
		outboxnotify.Committed(w.db)
	}
}

// Committed wakes the relays of this process of w's table, on MySQL,
// after a transaction whose commit the caller owns wrote rows through one
// of w's Publishers (the middleware calls it after its COMMIT). On
// PostgreSQL it does nothing: the transaction's NOTIFY wakes every relay.
func (w *Writer) Committed() { w.committed() }
