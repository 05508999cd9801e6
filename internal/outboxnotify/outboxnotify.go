// Package outboxnotify holds what the outbox's wake-on-commit shares with
// the other packages of the module: the NOTIFY channel of an outbox table
// (Channel, NotifySQL), and the advisory lock by which a relay's LISTEN
// session shows itself (LockListenerSQL, ListenerLockHeld: the console
// lists the relays by it).
package outboxnotify

import (
	"crypto/sha256"
	"encoding/hex"
	"strings"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Channel is the NOTIFY channel of db's outbox table, which its writers
// NOTIFY and its relays LISTEN on: "exactlyonce.<schema>.<table>", or,
// when that is longer than PostgreSQL's 63-byte identifier limit,
// "exactlyonce." and a hash of the name.
func Channel(db sqlschema.DB) string {
	db = db.WithDefaults()
	name := "exactlyonce." + db.Schema + "." + db.OutboxTable
	if len(name) <= 63 {
		return name
	}
	sum := sha256.Sum256([]byte(db.Schema + "." + db.OutboxTable))
	return "exactlyonce." + hex.EncodeToString(sum[:16])
}

// ListenerLockClass is the high 32 bits of the advisory lock key that a
// relay's LISTEN session holds: "eorl". The lock is one bigint, this class
// in its high 32 bits and the outbox table's oid in its low 32, so
// pg_locks shows it as locktype 'advisory', classid ListenerLockClass,
// objid the table's oid, objsubid 1 (a one-bigint key). The module's other
// advisory locks do not meet it: the outbox's per-key locks and the
// inbox's maintenance, purge and fallback locks are pairs of int4
// (objsubid 2); the inbox's per-key locks of the partitioned layout and
// Migrate's are bigints whose high 32 bits are a hash or another constant.
const ListenerLockClass = 0x656f726c

// LockListenerSQL takes, in the session (for as long as it lasts), a
// shared advisory lock that marks the session as a relay's LISTEN
// connection for the outbox table $1 (quoted and schema-qualified, as
// sqlschema.DB.Outbox returns it). Shared: every relay of the table holds
// it at once; nothing takes it exclusively. It returns true once held,
// NULL when the table does not exist (nothing is locked then).
const LockListenerSQL = `SELECT pg_try_advisory_lock_shared((` + classSQL + `::bigint << 32) | to_regclass($1)::oid::bigint)`

// classSQL is ListenerLockClass in decimal, for the SQL (TestListenerLock
// checks it against pg_locks).
const classSQL = "1701802604"

// ListenerLockHeld is the SQL condition that the row l of pg_locks is the
// lock LockListenerSQL takes, held, for the outbox table $1 (quoted and
// schema-qualified).
const ListenerLockHeld = `l.locktype = 'advisory' AND l.classid = ` + classSQL + `::oid AND l.objid = to_regclass($1)::oid AND l.objsubid = 1 AND l.granted`

// NotifySQL is the SQL expression that sends the NOTIFY of db's outbox
// table: a pg_notify call on Channel(db), with an empty payload.
func NotifySQL(db sqlschema.DB) string {
	return "pg_notify('" + strings.ReplaceAll(Channel(db), "'", "''") + "', '')"
}
