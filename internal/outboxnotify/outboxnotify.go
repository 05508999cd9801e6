// Package outboxnotify lets the middleware, which commits the transactions
// it writes outbox rows in, send their wake-on-commit NOTIFY right before
// the commit instead of with the first INSERT (see package outbox's
// notify.go). Package outbox sets AtCommit when it is initialised.
package outboxnotify

import (
	"context"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// AtCommit returns an outbox publisher writing to db's outbox table through
// tx whose writes send no NOTIFY, and beforeCommit, to call right before tx
// commits: when a write of the publisher succeeded, it sends the table's
// NOTIFY in tx unless another transaction of this process decided to send
// one within the debounce interval. Its error only means that no NOTIFY
// was sent (the transaction may be aborted, which its commit reports).
var AtCommit func(tx wsql.ContextExecutor, db sqlschema.DB) (pub message.Publisher, beforeCommit func(ctx context.Context) error, err error)
