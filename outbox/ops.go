package outbox

import (
	"context"
	"errors"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Pending describes the outbox backlog.
type Pending struct {
	// Count is the number of rows not relayed yet, quarantined ones
	// included.
	Count int64
	// OldestCreatedAt is the creation time of the oldest row not
	// quarantined: the lag of the live stream. Nil when there is none.
	OldestCreatedAt *time.Time
	// OldestAge is now() - OldestCreatedAt as the database sees it; zero
	// when there is no such row. Alert on it.
	OldestAge time.Duration
	// Failing counts rows not quarantined whose publish failed at least
	// once: they are retried with backoff, without blocking the rows behind
	// them, except the later rows of their ordering key (see Blocked). A
	// steady number means a broker problem or rows the broker refuses;
	// read their last_error column.
	Failing int64
	// Quarantined counts rows the relay gave up on, for failures that were
	// the message's own (see RelayConfig.MaxAttempts): skipped until
	// requeued. Alert on it, read their LastError (Store.Find), fix the
	// cause, then Store.RequeueFailed, or Requeue and Discard them one by one
	// or by filter. A quarantined row with an ordering key holds back the
	// later rows of its key (see Blocked).
	Quarantined int64
	// BlockedKeys counts the ordering keys (see msgid.OrderingKeyMetadata) that
	// have a failing or quarantined row: the relay publishes no later row
	// of such a key until that row is published, requeued (it goes first
	// again) or discarded (the key's next row goes). Alert on it staying
	// above zero; Store.Find with RowFilter.OrderingKey lists a key's failed
	// rows, each with the number of rows waiting behind it (Row.Waiting).
	BlockedKeys int64
	// Blocked counts the rows that wait behind a failing or quarantined
	// row of their ordering key (same key, lower id) and never failed
	// themselves: the relay holds them back until that row is published,
	// requeued or discarded. They are part of Count and, not being
	// quarantined, of OldestAge: a blocked key makes the lag grow.
	Blocked int64
}

// Pending reports the backlog of the outbox table. The count scans the
// table, which holds only unrelayed rows; BlockedKeys and Blocked read the
// ordering_key indexes of migration outbox_001 from each blocked key's
// first failed row on, a cost that grows with the rows blocked, not with
// the table.
func (s *Store) Pending(ctx context.Context) (Pending, error) {
	p, err := s.st.Pending(ctx, s.db.Conn)
	if err != nil {
		return Pending{}, s.fail("Pending", err)
	}
	out := Pending{Count: p.Count, OldestCreatedAt: p.OldestCreatedAt, Failing: p.Failing, Quarantined: p.Quarantined,
		BlockedKeys: p.BlockedKeys, Blocked: p.Blocked}
	if p.OldestAge != nil {
		out.OldestAge = time.Duration(*p.OldestAge * float64(time.Second))
	}
	return out, nil
}

// RequeueFailed clears the failure record of every row of the outbox table
// that has one (failures and permanent failures, backoff, quarantine, last
// error), so that quarantined rows are relayed again and failing rows are
// due at once. Use it after fixing the cause. It returns the number of rows
// cleared.
func (s *Store) RequeueFailed(ctx context.Context) (int64, error) {
	n, err := s.st.RequeueFailed(ctx, s.db.Conn)
	if err != nil {
		return 0, s.fail("RequeueFailed", err)
	}
	return n, nil
}

func checkDB(db sqlschema.DB) error {
	if db.Conn == nil {
		return errors.New("DB.Conn is nil: set it to wsql.BeginnerFromPgx(pool) or wsql.BeginnerFromStdSQL(db)")
	}
	return db.Validate()
}

// ifNotMigrated adds the not-migrated hint to an error that says the
// outbox table (or one of its columns) is missing.
func ifNotMigrated(db sqlschema.DB, err error) error {
	db = db.WithDefaults()
	return pgerr.IfNotMigrated(pgerr.Tables{Schema: db.Schema, Inbox: db.InboxTable, Outbox: db.OutboxTable}, err)
}
