package console

import (
	"context"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// What the database can tell about the relays of the outbox table: no
// relay registers itself, so the console reads PostgreSQL's own views,
// by what each session holds, never by its last statement.
const (
	// basisListen: the session holds the shared advisory lock a relay
	// takes on its LISTEN connection (outboxnotify.LockListenerSQL) for
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

// relaysSQL lists the sessions holding a relay's LISTEN lock or row locks
// on the outbox table ($1).
const relaysSQL = `SELECT a.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), ''), a.backend_start,
       coalesce(a.state, ''), a.state_change,
       EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND ` + outboxnotify.ListenerLockHeld + `),
       EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'relation' AND l.relation = to_regclass($1)
               AND l.mode = 'RowShareLock' AND l.granted)
FROM pg_stat_activity a
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND a.pid IN (SELECT l.pid FROM pg_locks l WHERE (` + outboxnotify.ListenerLockHeld + `)
       OR (l.locktype = 'relation' AND l.relation = to_regclass($1) AND l.mode = 'RowShareLock' AND l.granted))
ORDER BY a.backend_start, a.pid
LIMIT 1000`

// relays lists the sessions that look like the outbox's relays.
func (h *handler) relays(ctx context.Context) ([]relayInfo, error) {
	db := h.cfg.DB
	rows, err := db.Conn.QueryContext(ctx, relaysSQL, db.Outbox())
	if err != nil {
		return nil, err
	}
	out := []relayInfo{}
	for rows.Next() {
		var r relayInfo
		var listening, locking bool
		if err := rows.Scan(&r.PID, &r.ApplicationName, &r.ClientAddr, &r.BackendStart, &r.State, &r.StateChange, &listening, &locking); err != nil {
			_ = rows.Close()
			return nil, err
		}
		r.BasedOn = []string{}
		if listening {
			r.BasedOn = append(r.BasedOn, basisListen)
		}
		if locking {
			r.BasedOn = append(r.BasedOn, basisBatch)
		}
		out = append(out, r)
	}
	if err := seam.Close(rows); err != nil {
		return nil, err
	}
	return out, nil
}
