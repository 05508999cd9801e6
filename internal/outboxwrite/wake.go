package outboxwrite

// committed is called after a transaction that Publish began and committed
// itself (a Publisher bound to a pool or a *sql.DB) wrote rows. On MySQL,
// which has no NOTIFY, it is where the relays of this process are to be
// woken in-process (the relay's side owns that registry); transactions
// whose commit is the caller's are signalled by the caller after it
// commits. On PostgreSQL the transaction's NOTIFY did it.
//
// TODO(issue 31, merge of wt-relay): if w.mysql, call
// outboxnotify.Committed(w.db) here; this branch has no in-process
// registry yet.
func (w *Writer) committed() {
	_ = w.db
}
