// Package outboxnotify holds what the outbox's wake-on-commit shares with
// the other packages of the module: the NOTIFY channel of an outbox table
// (Channel), and the class of the advisory lock by which a relay's LISTEN
// session shows itself (ListenerLockClass; the statements that take it and
// list the sessions holding it are internal/outboxdb's LockListener and
// Relays: the console lists the relays by it).
package outboxnotify

import (
	"crypto/sha256"
	"encoding/hex"

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
