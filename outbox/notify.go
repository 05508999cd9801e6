package outbox

import (
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Wake-on-commit, the relay's side. A transaction that writes outbox rows
// also sends a PostgreSQL NOTIFY on the table's channel, which PostgreSQL
// delivers when (and only if) the transaction commits; a Relay LISTENs on a
// connection of its own (wake.go) and relays at once instead of waiting out
// its PollInterval.
//
// The writers of a Writer (and the middleware's) debounce their NOTIFYs
// (internal/outboxwrite's notify.go): a transaction sends one only when no
// transaction of its Writer sent one in the last 10 ms. A transaction that
// skipped it is covered by the Relay's catch-up: after a pass that relayed
// rows, the Relay polls every catchUpPoll until catchUpWindow passes
// without a row, so a row committed shortly after a notified one leaves
// within catchUpPoll. A row committed later than that without a NOTIFY of
// its own waits for the PollInterval poll, as it would without
// wake-on-commit: polling stays the fallback and the bound.
const (
	catchUpWindow = 40 * time.Millisecond
	catchUpPoll   = 2 * time.Millisecond
)

// On MySQL/MariaDB there is no NOTIFY: a Relay polls, and is woken at
// once only by the writers of its own process, through a process-wide
// registry (internal/outboxnotify's Subscribe and Committed): the
// exactly-once middleware signals it after it commits a transaction that
// wrote outbox rows, and an application that commits its own transaction
// calls WakeRelays. Rows committed by other processes are relayed at the
// next poll (RelayConfig.PollInterval).

// WakeRelays wakes the Relays of this process that relay db's outbox
// table, on MySQL/MariaDB: call it after committing a transaction that
// wrote outbox rows through a Writer (the exactly-once middleware does it
// for the transactions it commits). It never blocks, and does nothing
// when no such Relay runs. On PostgreSQL the writers' NOTIFY wakes every
// listening Relay, of any process, and WakeRelays is not needed (it only
// wakes none: Relays on PostgreSQL LISTEN instead).
func WakeRelays(db sqlschema.DB) { outboxnotify.Committed(db) }

// channelName is the NOTIFY channel of db's outbox table
// (outboxnotify.Channel: the console reads it too).
func channelName(db sqlschema.DB) string { return outboxnotify.Channel(db) }
