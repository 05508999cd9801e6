package outboxnotify

import (
	"sync"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The in-process wake-on-commit, for MySQL/MariaDB (which has no
// LISTEN/NOTIFY): a process-wide registry, by outbox table, of the relays
// of this process (Subscribe), which the outbox's writers of this process
// signal once the transaction that wrote rows committed (Committed). Writes
// committed by other processes are not signalled: the relays see them at
// their next poll (RelayConfig.PollInterval).

// registry is the process's subscriptions, by table (key).
var registry = struct {
	sync.Mutex
	subs map[string]map[*subscription]struct{}
}{subs: map[string]map[*subscription]struct{}{}}

type subscription struct{ ch chan struct{} }

// key identifies db's outbox table in the registry: its dialect, database
// (schema) and name. Two servers with tables of one name share a key: a
// write to one wakes the relays of both, which costs them one poll.
func key(db sqlschema.DB) string {
	db = db.WithDefaults()
	return db.Dialect.String() + "\x00" + db.Schema + "\x00" + db.OutboxTable
}

// Subscribe registers a relay of db's outbox table: the channel returned
// receives a value (one pending at most: signals do not accumulate) after
// each Committed of that table. cancel removes the subscription.
func Subscribe(db sqlschema.DB) (wake <-chan struct{}, cancel func()) {
	k := key(db)
	s := &subscription{ch: make(chan struct{}, 1)}
	registry.Lock()
	if registry.subs[k] == nil {
		registry.subs[k] = map[*subscription]struct{}{}
	}
	registry.subs[k][s] = struct{}{}
	registry.Unlock()
	var once sync.Once
	return s.ch, func() {
		once.Do(func() {
			registry.Lock()
			delete(registry.subs[k], s)
			if len(registry.subs[k]) == 0 {
				delete(registry.subs, k)
			}
			registry.Unlock()
		})
	}
}

// Committed wakes the relays of this process subscribed to db's outbox
// table: call it after a transaction that wrote rows to it committed. It
// never blocks, and costs a map lookup when no relay of the table runs in
// the process.
func Committed(db sqlschema.DB) {
	k := key(db)
	registry.Lock()
	defer registry.Unlock()
	for s := range registry.subs[k] {
		select {
		case s.ch <- struct{}{}:
		default:
		}
	}
}
