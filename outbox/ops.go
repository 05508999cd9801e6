package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
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
	// requeued. Alert on it, read their LastError (FindRows), fix the
	// cause, then RequeueFailed, or Requeue and Discard them one by one
	// or by filter. A quarantined row with an ordering key holds back the
	// later rows of its key (see Blocked).
	Quarantined int64
	// BlockedKeys counts the ordering keys (see msgid.OrderingKeyMetadata) that
	// have a failing or quarantined row: the relay publishes no later row
	// of such a key until that row is published, requeued (it goes first
	// again) or discarded (the key's next row goes). Alert on it staying
	// above zero; FindRows with RowFilter.OrderingKey lists a key's failed
	// rows, each with the number of rows waiting behind it (Row.Waiting).
	BlockedKeys int64
	// Blocked counts the rows that wait behind a failing or quarantined
	// row of their ordering key (same key, lower id) and never failed
	// themselves: the relay holds them back until that row is published,
	// requeued or discarded. They are part of Count and, not being
	// quarantined, of OldestAge: a blocked key makes the lag grow.
	Blocked int64
}

// PendingStats reports the backlog of db's outbox table. The count scans
// the table, which holds only unrelayed rows; BlockedKeys and Blocked read
// the ordering_key indexes of migration outbox_001 from each blocked key's
// first failed row on, a cost that grows with the rows blocked, not with
// the table. db.Conn is required.
func PendingStats(ctx context.Context, db sqlschema.DB) (Pending, error) {
	if err := checkDB(db); err != nil {
		return Pending{}, fmt.Errorf("outbox: PendingStats: %w", err)
	}
	tables := db
	var p Pending
	var ageSeconds *float64
	// A key is blocked from its first failed row on (failures > 0, which
	// quarantined rows have too: the relay's own test of a row it may
	// take). Its blocked rows are counted from the ordering_key index
	// between that row and the key's end, not by a test of every row of
	// the scan: with no blocked key the statement costs what the scan
	// does.
	err := seam.QueryRow(ctx, db.Conn,
		`WITH failed AS (
  SELECT ordering_key, min(id) AS first FROM `+tables.Outbox()+`
  WHERE ordering_key IS NOT NULL AND failures > 0 GROUP BY ordering_key
)
SELECT count(*),
       min(created_at) FILTER (WHERE quarantined_at IS NULL),
       extract(epoch FROM now() - min(created_at) FILTER (WHERE quarantined_at IS NULL))::float8,
       count(*) FILTER (WHERE failures > 0 AND quarantined_at IS NULL),
       count(*) FILTER (WHERE quarantined_at IS NOT NULL),
       (SELECT count(*) FROM failed),
       (SELECT count(*) FROM failed f JOIN `+tables.Outbox()+` b ON b.ordering_key = f.ordering_key AND b.id > f.first WHERE b.failures = 0)
FROM `+tables.Outbox(),
		nil, &p.Count, &p.OldestCreatedAt, &ageSeconds, &p.Failing, &p.Quarantined, &p.BlockedKeys, &p.Blocked)
	if err != nil {
		return Pending{}, fmt.Errorf("outbox: PendingStats: %w", ifNotMigrated(db, err))
	}
	if ageSeconds != nil {
		p.OldestAge = time.Duration(*ageSeconds * float64(time.Second))
	}
	return p, nil
}

// RequeueFailed clears the failure record of every row of db's outbox table
// that has one (failures and permanent failures, backoff, quarantine, last
// error), so that quarantined rows are relayed again and failing rows are
// due at once. Use it after fixing the cause. It returns the number of rows
// cleared. db.Conn is required.
func RequeueFailed(ctx context.Context, db sqlschema.DB) (int64, error) {
	if err := checkDB(db); err != nil {
		return 0, fmt.Errorf("outbox: RequeueFailed: %w", err)
	}
	tables := db
	n, err := seam.Exec(ctx, db.Conn, `UPDATE `+tables.Outbox()+` SET `+clearFailures+`
WHERE failures > 0 OR attempts > 0 OR quarantined_at IS NOT NULL OR next_attempt_at IS NOT NULL`)
	if err != nil {
		return 0, fmt.Errorf("outbox: RequeueFailed: %w", ifNotMigrated(db, err))
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
