package console

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// What the database can tell about the relays of the outbox table: no
// relay registers itself, so the console reads PostgreSQL's own views.
const (
	// basisListen: the session's last statement is the LISTEN on the
	// outbox's channel: a relay's wake-on-commit connection.
	basisListen = "listen"
	// basisBatch: the session holds row locks (FOR UPDATE) on the outbox
	// table now: a relay with a batch in flight (or, for an instant, an
	// operator's requeue or discard).
	basisBatch = "batch_lock"
)

// relaysNote says what the list of relays can miss.
const relaysNote = "Relays are found in pg_stat_activity and pg_locks: a session whose last statement is the LISTEN on the outbox's " +
	"channel (a relay that wakes on commit), or that holds row locks on the outbox table (a relay with a batch in flight). " +
	"A relay that polls only (NoListen, or behind PgBouncer without ListenConnString) is seen only while a batch is in flight; " +
	"one whose LISTEN connection was quiet for 30 s shows its keep-alive ping as its last statement and is missed until the next notification; " +
	"sessions of other database roles are visible only to a role with pg_read_all_stats."

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
// LISTEN on: outbox's channelName (outbox/notify.go), which this must
// match; the console's relay test checks that it finds a running relay by
// it.
func notifyChannel(db sqlschema.DB) string {
	db = db.WithDefaults()
	name := "exactlyonce." + db.Schema + "." + db.OutboxTable
	if len(name) <= 63 {
		return name
	}
	sum := sha256.Sum256([]byte(db.Schema + "." + db.OutboxTable))
	return "exactlyonce." + hex.EncodeToString(sum[:16])
}

const relaysSQL = `SELECT a.pid, coalesce(a.application_name, ''), coalesce(host(a.client_addr), ''), a.backend_start,
       coalesce(a.state, ''), a.state_change, a.query = $1,
       EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'relation' AND l.relation = to_regclass($2)
               AND l.mode = 'RowShareLock' AND l.granted)
FROM pg_stat_activity a
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND (a.query = $1 OR EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'relation'
       AND l.relation = to_regclass($2) AND l.mode = 'RowShareLock' AND l.granted))
ORDER BY a.backend_start, a.pid
LIMIT 1000`

// relays lists the sessions that look like the outbox's relays.
func (h *handler) relays(ctx context.Context) ([]relayInfo, error) {
	db := h.cfg.DB
	listen := "LISTEN " + pgx.Identifier{notifyChannel(db)}.Sanitize()
	rows, err := db.Conn.QueryContext(ctx, relaysSQL, listen, db.Outbox())
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
