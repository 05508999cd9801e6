package console

import (
	"context"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// What the database can tell about the relays of the outbox table: no
// relay registers itself, so the console reads PostgreSQL's own views,
// by what each session holds, never by its last statement.
const (
	// basisListen: the session holds the shared advisory lock a relay
	// takes on its LISTEN connection (internal/outboxdb's LockListener) for
	// as long as it listens: a relay that wakes on commit.
	basisListen = "listen"
	// basisBatch: the session holds row locks (FOR UPDATE) on the outbox
	// table now: a relay with a batch in flight (or, for an instant, an
	// operator's requeue or discard).
	basisBatch = "batch_lock"
)

// relaysNote says what the list of relays can miss.
const relaysNote = "Relays are found in pg_locks: a relay that wakes on commit holds an advisory lock of the outbox table on its LISTEN " +
	"connection for as long as it listens (listen), and a relay with a batch in flight holds row locks on the outbox table (batch_lock). " +
	"A relay that polls only (NoListen, or behind PgBouncer without ListenConnString) is seen only while a batch is in flight; " +
	"a session of another database role shows only its pid and application name unless the console's role has pg_read_all_stats."

// relaysNoteMySQL is the note of the relays on MySQL/MariaDB, where the
// list is not available.
const relaysNoteMySQL = "The list of relays is not available on MySQL: it reads PostgreSQL's pg_locks (a relay's advisory lock on its LISTEN " +
	"connection, its row locks), and MySQL/MariaDB has neither LISTEN nor a view the console could read the same way. " +
	"The outbox's backlog above, and the relay's metrics, say whether rows are relayed."

// relaysAvailable reports whether the database can tell about the relays:
// PostgreSQL only (outboxdb's Relays is sqlschema.ErrUnsupported on MySQL).
func (h *handler) relaysAvailable() bool { return h.cfg.DB.Dialect != sqlschema.MySQL }

// relaysNoteOf is the note that goes with the list of relays.
func (h *handler) relaysNoteOf() string {
	if !h.relaysAvailable() {
		return relaysNoteMySQL
	}
	return relaysNote
}

// relayInfo is a session that looks like a relay's.
type relayInfo struct {
	PID             int32      `json:"pid"`
	ApplicationName string     `json:"application_name"`
	ClientAddr      string     `json:"client_addr"`
	BackendStart    *time.Time `json:"backend_start"`
	State           string     `json:"state"`
	StateChange     *time.Time `json:"state_change"`
	// BasedOn says what the entry is based on: "listen" and/or
	// "batch_lock".
	BasedOn []string `json:"based_on"`
}

// notifyChannel is the channel the outbox's writers NOTIFY and its relays
// LISTEN on.
func notifyChannel(db sqlschema.DB) string { return outboxnotify.Channel(db) }

// relays lists the sessions that look like the outbox's relays.
// On MySQL, where the list is not available, it is empty.
func (h *handler) relays(ctx context.Context) ([]relayInfo, error) {
	if !h.relaysAvailable() {
		return []relayInfo{}, nil
	}
	// The statement is internal/outboxdb's Relays. (The store is built per
	// call: the handler could keep one.)
	st, err := outboxdb.New(h.cfg.DB)
	if err != nil {
		return nil, err
	}
	sessions, err := st.Relays(ctx, h.cfg.DB.Conn)
	if err != nil {
		return nil, err
	}
	out := make([]relayInfo, 0, len(sessions))
	for _, s := range sessions {
		r := relayInfo{PID: s.PID, ApplicationName: s.ApplicationName, ClientAddr: s.ClientAddr, BackendStart: s.BackendStart,
			State: s.State, StateChange: s.StateChange, BasedOn: []string{}}
		if s.Listening {
			r.BasedOn = append(r.BasedOn, basisListen)
		}
		if s.Locking {
			r.BasedOn = append(r.BasedOn, basisBatch)
		}
		out = append(out, r)
	}
	return out, nil
}
