package outbox

import (
	"context"
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/internal/parked"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The operator's view of the rows the relay gave up on (quarantined) or is
// retrying (failing): find them by id, topic, message UUID, error text,
// quarantine time, ordering key or a metadata field such as a business id
// (each row says how many rows of its ordering key wait behind it), without
// their payloads; read one with its payload, or with a bounded prefix of it
// (GetRowPrefix); requeue it (the relay sends it again at once) or discard it
// (it is never published), one by one or every row a filter selects.
// Searches of quarantined rows use the partial quarantined_* indexes of
// migration outbox_001, which hold quarantined rows only: measured on
// 50,000 rows of which 1,000 quarantined, a search by a metadata field or a
// UUID takes under 0.1 ms (a sequential scan of 8-14 ms without them).

var (
	// ErrRowNotFound is returned (wrapped) by GetRow, Requeue and Discard
	// for an id that has no outbox row: it was relayed (rows are deleted
	// once published), discarded, or never existed.
	ErrRowNotFound = errors.New("no such outbox row: relayed, discarded, or never written")
	// ErrNotQuarantined is returned (wrapped) by Requeue and Discard for a
	// row that exists but is not quarantined: the relay still owns it (it
	// is in the live backlog, or failing and retried after its backoff),
	// or another operator requeued it first. Nothing was changed.
	ErrNotQuarantined = errors.New("outbox row is not quarantined")
	// ErrChanged is returned (wrapped) by Requeue and Discard given an
	// Expect that no longer holds: the row's failure record is not the one
	// the operator was shown (it was requeued and failed again, say).
	// Nothing was changed. It is inbox.ErrChanged too.
	ErrChanged = parked.ErrChanged
	// ErrTooBroad is returned (wrapped) by FindRows, CountRows and
	// CountRowsAsOf for a filter whose read would exceed its bound
	// (RowFilter.MaxScan, MaxCount); the error says which and how to
	// narrow the filter. Nothing was read.
	ErrTooBroad = errors.New("the filter selects too many outbox rows for the bound of this read")
)

// Expect is what an operator (a page, a script) was shown of an outbox row
// before acting on it: Requeue and Discard act only while the row is
// still so, checked under the row's lock in the transaction that acts,
// and otherwise return an error wrapping ErrChanged. The zero Expect
// checks nothing.
type Expect struct {
	// Version is the row's Version that was shown.
	Version string
}

// RowState selects outbox rows by their failure record.
type RowState string

const (
	// StateQuarantined selects the rows the relay gave up on, for failures
	// that were the message's own (see RelayConfig.MaxAttempts): it skips
	// them until they are requeued or discarded. The default.
	StateQuarantined RowState = "quarantined"
	// StateFailing selects the rows whose publish failed at least once and
	// that are not quarantined: the relay retries each after its backoff.
	StateFailing RowState = "failing"
	// StateAll selects both: every row with a failure record. Rows that
	// never failed (the live backlog, which PendingStats counts) are never
	// selected.
	StateAll RowState = "all"
)

// Limits of the operator functions.
const (
	// DefaultRowLimit is the page size of FindRows when Paging.Limit is 0.
	DefaultRowLimit = 100
	// MaxRowLimit is the largest Paging.Limit.
	MaxRowLimit = 1000
	// MaxFilterIDs is the most ids a RowFilter may name.
	MaxFilterIDs = 10000
	// matchingBatch is how many rows RequeueMatching and DiscardMatching
	// change per statement (each its own short transaction).
	matchingBatch = 500
)

// Row is an outbox row as stored, with its failure record.
type Row struct {
	// ID is the row's id: the order of insertion, and what Requeue,
	// Discard and RowFilter.IDs take.
	ID int64
	// Topic is the destination topic.
	Topic string
	// UUID is the message's UUID, which the relay publishes it with.
	UUID string
	// Payload is the message's payload: all of it from GetRow, at most
	// its first bytes from GetRowPrefix, and nil in FindRows' pages, which
	// read no payload (PayloadSize says how large it is).
	Payload []byte
	// PayloadSize is the size of the whole payload in bytes, whatever
	// Payload holds of it.
	PayloadSize int
	// Metadata is the message's metadata; nil when the stored metadata is
	// not a JSON object of strings (the relay quarantines such a row at
	// once, and its LastError says so).
	Metadata map[string]string
	// RawMetadata is the metadata as stored (JSON).
	RawMetadata json.RawMessage
	// CreatedAt is when the row was written.
	CreatedAt time.Time
	// QuarantinedAt is when the relay quarantined the row; nil when it is
	// not quarantined.
	QuarantinedAt *time.Time
	// Failures counts every failed publish of the row (it drives the
	// backoff).
	Failures int
	// PermanentFailures counts the failures that were the message's own;
	// at RelayConfig.MaxAttempts the row is quarantined.
	PermanentFailures int
	// NextAttemptAt is when the relay tries a failing row again; nil when
	// it is due now (or quarantined: the relay skips it).
	NextAttemptAt *time.Time
	// LastError is the error of the row's latest failed publish; "" when
	// none.
	LastError string
	// OrderingKey is the message's ordering key (see msgid.OrderingKeyMetadata);
	// "" when it has none.
	OrderingKey string
	// Version identifies the row's failure record: it changes whenever the
	// relay records a failure, the row is quarantined, or an operator
	// requeues it. Pass it in Expect.Version to requeue or discard exactly
	// what was shown. Compare it; never parse it.
	Version string
	// Waiting is, for a failing or quarantined row with an ordering key,
	// the number of rows of its key written after it (a larger id): the
	// relay holds them back until this row is published, requeued (it
	// goes first again) or discarded (the key's next row goes). Zero for a
	// row without a key, and for a row that never failed (it holds back
	// nothing the relay would not publish right after it).
	Waiting int64
}

// Quarantined reports whether the relay gave up on the row.
func (r Row) Quarantined() bool { return r.QuarantinedAt != nil }

// RowFilter selects outbox rows by their failure record. Every field set
// must match (AND); an empty field matches every row. The zero RowFilter
// selects every quarantined row.
type RowFilter struct {
	// State is StateQuarantined, StateFailing or StateAll. Defaults to
	// StateQuarantined.
	State RowState
	// IDs, when not empty, selects these rows only (at most MaxFilterIDs).
	IDs []int64
	// Topic selects the rows of this destination topic.
	Topic string
	// UUID selects the rows of this message UUID (a message fanned out to
	// several topics has one row per topic).
	UUID string
	// Reason selects the rows whose last error contains this text, ignoring
	// case.
	Reason string
	// QuarantinedSince selects the rows quarantined at or after this time.
	// A time range selects quarantined rows only: with StateAll, the
	// failing rows do not match it; with StateFailing it is an error.
	QuarantinedSince time.Time
	// QuarantinedBefore selects the rows quarantined before this time (see
	// QuarantinedSince).
	QuarantinedBefore time.Time
	// Metadata selects the rows whose metadata has every one of these
	// fields with exactly this value (a business id such as "order_id"
	// that the producer set, say).
	Metadata map[string]string
	// OrderingKey selects the rows of this ordering key (see
	// msgid.OrderingKeyMetadata): the failed rows that block the key, with
	// StateAll both its quarantined and its failing ones.
	OrderingKey string

	// MaxScan, when positive, bounds the work of FindRows, CountRows and
	// CountRowsAsOf for a filter that Scans (Reason: no index holds the
	// error's text): they are refused (ErrTooBroad) when the other
	// conditions select more than MaxScan rows to check it on, and
	// otherwise read only those (counted on the indexes first, in the same
	// snapshot). Defaults to 0: no bound. RequeueMatching and
	// DiscardMatching ignore it (count first).
	MaxScan int
	// MaxCount, when positive, bounds CountRows and CountRowsAsOf: a count
	// of more than MaxCount rows is refused (ErrTooBroad); they count at
	// most MaxCount+1. Defaults to 0: no bound.
	MaxCount int

	// AsOf and MaxID bound the rows to those a count could see
	// (CountRowsAsOf returns both): give them to RequeueMatching or
	// DiscardMatching after the operator confirmed the count, and the rows
	// acted on are among the rows counted that still match; the set can
	// only shrink.
	//
	// AsOf, when set, selects the quarantined rows quarantined at or before
	// AsOf: a row quarantined after it, or requeued and quarantined again,
	// is not selected. Failing rows hold no time of their failure: AsOf
	// does not select among them (with StateFailing or StateAll they are
	// bounded by MaxID only, so a row written before the count that fails
	// for the first time after it is selected). AsOf is a time of the
	// database's clock (the relay stamps quarantined_at with it).
	AsOf time.Time
	// MaxID, when positive, selects the rows whose id is at most MaxID: no
	// row written after the count (ids grow with each row written).
	MaxID int64
}

// RowCount is a count of rows and the bounds of what it counted
// (CountRowsAsOf).
type RowCount struct {
	// Count is the number of rows counted.
	Count int64
	// AsOf is the database's time of the count (RowFilter.AsOf when it was
	// set).
	AsOf time.Time
	// MaxID is the largest id counted; 0 when none (then RowFilter.MaxID
	// bounds nothing: act on nothing).
	MaxID int64
}

// Paging is a page of FindRows: rows with ids above After, oldest (lowest
// id) first.
type Paging struct {
	// After is the keyset cursor: only rows with a larger id are read. Use
	// the RowPage.Next of the previous page. Defaults to 0 (the first
	// page).
	After int64
	// Limit is the most rows on the page, at most MaxRowLimit. Defaults to
	// DefaultRowLimit.
	Limit int
}

// RowPage is a page of rows, oldest first.
type RowPage struct {
	// Rows are the rows of the page, in id order.
	Rows []Row
	// Next is the Paging.After that reads the next page; 0 when this page
	// is the last.
	Next int64
}

// FindRows returns a page of the rows of db's outbox table that f selects
// (by default the quarantined ones), oldest first, without their payloads
// (Row.Payload is nil; Row.PayloadSize is the payload's size): the rows the
// relay quarantines are often those whose payload is too large for the
// broker, and a page of them would weigh what their payloads weigh. Read
// one row's payload with GetRow or GetRowPrefix. A row relayed, requeued or
// discarded between two pages is not shown twice: paging goes by id.
// db.Conn is required.
func FindRows(ctx context.Context, db sqlschema.DB, f RowFilter, p Paging) (RowPage, error) {
	const op = "FindRows"
	if err := checkDB(db); err != nil {
		return RowPage{}, fmt.Errorf("outbox: %s: %w", op, err)
	}
	if err := f.validate(op); err != nil {
		return RowPage{}, err
	}
	if p.After < 0 {
		return RowPage{}, fmt.Errorf("outbox: %s: Paging.After is %d: use 0 for the first page, RowPage.Next for the next", op, p.After)
	}
	if p.Limit < 0 || p.Limit > MaxRowLimit {
		return RowPage{}, fmt.Errorf("outbox: %s: Paging.Limit is %d: it must be between 1 and %d (0 for %d)", op, p.Limit, MaxRowLimit, DefaultRowLimit)
	}
	limit := p.Limit
	if limit == 0 {
		limit = DefaultRowLimit
	}
	query, args := findSQL(db, f, p.After, limit+1)
	var page RowPage
	err := boundedRead(ctx, db, f, func(conn wsql.ContextExecutor) error {
		rs, err := conn.QueryContext(ctx, query, args...)
		if err != nil {
			return err
		}
		for rs.Next() {
			r, err := scanRow(rs)
			if err != nil {
				_ = rs.Close()
				return err
			}
			page.Rows = append(page.Rows, r)
		}
		return seam.Close(rs)
	})
	if err != nil {
		return RowPage{}, fmt.Errorf("outbox: %s: %w", op, ifNotMigrated(db, err))
	}
	if len(page.Rows) > limit {
		page.Rows = page.Rows[:limit]
		page.Next = page.Rows[limit-1].ID
	}
	return page, nil
}

// CountRows returns the number of rows of db's outbox table that f selects
// (by default the quarantined ones). To confirm a count before
// RequeueMatching or DiscardMatching, use CountRowsAsOf: the action then
// acts on no row the count did not see. db.Conn is required.
func CountRows(ctx context.Context, db sqlschema.DB, f RowFilter) (int64, error) {
	const op = "CountRows"
	if err := checkDB(db); err != nil {
		return 0, fmt.Errorf("outbox: %s: %w", op, err)
	}
	if err := f.validate(op); err != nil {
		return 0, err
	}
	query, args := countSQL(db, f)
	var n int64
	err := boundedRead(ctx, db, f, func(conn wsql.ContextExecutor) error {
		if err := seam.QueryRow(ctx, conn, query, args, &n); err != nil {
			return err
		}
		return f.checkCount(n)
	})
	if err != nil {
		return 0, fmt.Errorf("outbox: %s: %w", op, ifNotMigrated(db, err))
	}
	return n, nil
}

// CountRowsAsOf counts as CountRows does, at the database's current time
// (or at f.AsOf when it is set), and returns the bounds of what it
// counted: the time (RowCount.AsOf) and the largest id (RowCount.MaxID).
// Count, have the count confirmed, then act with f.AsOf and f.MaxID set
// to them: RequeueMatching and DiscardMatching then act on rows the count
// saw, never on one quarantined or written after it. Count again with the
// bounds just before acting, to check that the confirmed count still
// holds (a row requeued, relayed or discarded meanwhile drops out). One
// window remains: a row the relay quarantined (its time stamped by the
// relay's statement, before AsOf) in a transaction that committed after
// the count read the table was not counted, and, when its id is below
// MaxID, is within the bounds; the window is the relay's commit after that
// statement. db.Conn is required.
func CountRowsAsOf(ctx context.Context, db sqlschema.DB, f RowFilter) (RowCount, error) {
	const op = "CountRowsAsOf"
	if err := checkDB(db); err != nil {
		return RowCount{}, fmt.Errorf("outbox: %s: %w", op, err)
	}
	if err := f.validate(op); err != nil {
		return RowCount{}, err
	}
	if f.AsOf.IsZero() {
		if err := seam.QueryRow(ctx, db.Conn, `SELECT now()`, nil, &f.AsOf); err != nil {
			return RowCount{}, fmt.Errorf("outbox: %s: %w", op, err)
		}
	}
	where, args := f.where()
	q := `SELECT count(*), coalesce(max(id), 0) FROM ` + db.Outbox() + ` WHERE ` + where
	if f.MaxCount > 0 {
		// MaxCount+1 rows at most: enough to refuse; a count within the
		// bound read them all, and its max(id) is theirs.
		args = append(args, f.MaxCount+1)
		q = `SELECT count(*), coalesce(max(id), 0) FROM (SELECT id FROM ` + db.Outbox() + ` WHERE ` + where +
			` LIMIT $` + strconv.Itoa(len(args)) + `) c`
	}
	c := RowCount{AsOf: f.AsOf}
	err := boundedRead(ctx, db, f, func(conn wsql.ContextExecutor) error {
		if err := seam.QueryRow(ctx, conn, q, args, &c.Count, &c.MaxID); err != nil {
			return err
		}
		return f.checkCount(c.Count)
	})
	if err != nil {
		return RowCount{}, fmt.Errorf("outbox: %s: %w", op, ifNotMigrated(db, err))
	}
	return c, nil
}

// Scans reports whether f has a condition no index serves, which a read
// checks on each row its other conditions select: Reason (the last
// error's text). Bound such a read with MaxScan where one caller's
// request must not read every failed row (a console, an API).
func (f RowFilter) Scans() bool { return f.Reason != "" }

// checkCount refuses a count over f.MaxCount (counted up to MaxCount+1).
func (f RowFilter) checkCount(n int64) error {
	if f.MaxCount > 0 && n > int64(f.MaxCount) {
		return fmt.Errorf("%w: more than %d rows match (the bound of this count, MaxCount): narrow the filter by a topic, a time "+
			"range (QuarantinedSince, QuarantinedBefore), a metadata field such as a business id, a message UUID or an ordering key",
			ErrTooBroad, f.MaxCount)
	}
	return nil
}

// boundedRead runs read (a find or count of f) on db; for a filter with
// MaxScan that Scans, in a read-only REPEATABLE READ transaction that first
// counts, on the indexes (no sequential scan), the rows f's other
// conditions select (up to MaxScan+1) and refuses when there are more than
// MaxScan (ErrTooBroad), then plans the read through those indexes'
// bitmaps, not by a sequential scan of the table nor a walk of an index in
// its order (a random read per row), as the inbox's parked messages are
// read (inboxdb.Store.BoundedScan): the check and the read see the same
// rows, and the read's work is bounded by MaxScan.
func boundedRead(ctx context.Context, db sqlschema.DB, f RowFilter, read func(conn wsql.ContextExecutor) error) error {
	if f.MaxScan <= 0 || !f.Scans() {
		return read(db.Conn)
	}
	tx, err := db.Conn.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelRepeatableRead, ReadOnly: true})
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }() // read-only: nothing to keep
	var a, b string
	if err := seam.QueryRow(ctx, tx, `SELECT set_config('enable_seqscan', 'off', true), set_config('jit', 'off', true)`, nil, &a, &b); err != nil {
		return err
	}
	indexed := f
	indexed.Reason = ""
	where, args := indexed.where()
	args = append(args, f.MaxScan+1)
	// set_config runs once this statement is planned: the check reads the
	// indexes as it will, the read after it through their bitmaps.
	var n int64
	if err := seam.QueryRow(ctx, tx, `SELECT count(*), set_config('enable_indexscan', 'off', true) FROM (SELECT 1 FROM `+db.Outbox()+
		` WHERE `+where+` LIMIT $`+strconv.Itoa(len(args))+`) c`, args, &n, &a); err != nil {
		return err
	}
	if n > int64(f.MaxScan) {
		return fmt.Errorf("%w: the last error's text (Reason), which no index serves, would be checked on more than %d rows (the bound of "+
			"this read, MaxScan): narrow the filter by a topic, a time range (QuarantinedSince, QuarantinedBefore), a metadata field such "+
			"as a business id, a message UUID or an ordering key", ErrTooBroad, f.MaxScan)
	}
	return read(tx)
}

// GetRow returns the row of db's outbox table with this id with its whole
// payload, whatever its state (Row.Quarantined, Row.Failures tell it), or
// ErrRowNotFound. A row's payload can be as large as the broker refused (a
// quarantined row's often is): to show a row, GetRowPrefix reads a bounded
// part of it. db.Conn is required.
func GetRow(ctx context.Context, db sqlschema.DB, id int64) (Row, error) {
	return getRow(ctx, db, "GetRow", id, `o.payload`, nil)
}

// GetRowPrefix is GetRow with at most the first maxPayload bytes of the
// row's payload in Row.Payload (Row.PayloadSize is the whole payload's
// size: the payload is cut when it is larger). The database reads and
// sends that prefix only (substring of the stored value), so that showing
// a row costs the same whatever its payload's size. maxPayload is at least
// 0 (0 reads no payload). db.Conn is required.
func GetRowPrefix(ctx context.Context, db sqlschema.DB, id int64, maxPayload int) (Row, error) {
	const op = "GetRowPrefix"
	if maxPayload < 0 {
		return Row{}, fmt.Errorf("outbox: %s: maxPayload is %d: the most bytes of the payload to read, at least 0", op, maxPayload)
	}
	return getRow(ctx, db, op, id, `substring(o.payload FROM 1 FOR $2)`, []any{maxPayload})
}

// getRow reads row id with payload (an expression of the row as o; its
// arguments, from $2, in args) as its payload.
func getRow(ctx context.Context, db sqlschema.DB, op string, id int64, payload string, args []any) (Row, error) {
	if err := checkID(op, db, id); err != nil {
		return Row{}, err
	}
	rs, err := db.Conn.QueryContext(ctx, `SELECT `+rowColumns(db.Outbox(), payload)+` FROM `+db.Outbox()+` o WHERE id = $1`,
		append([]any{id}, args...)...)
	if err != nil {
		return Row{}, fmt.Errorf("outbox: %s: %w", op, ifNotMigrated(db, err))
	}
	if !rs.Next() {
		if err := seam.Close(rs); err != nil {
			return Row{}, fmt.Errorf("outbox: %s: %w", op, ifNotMigrated(db, err))
		}
		return Row{}, fmt.Errorf("outbox: %s: row %d: %w", op, id, ErrRowNotFound)
	}
	r, err := scanRow(rs)
	if err != nil {
		_ = rs.Close()
		return Row{}, fmt.Errorf("outbox: %s: %w", op, err)
	}
	if err := seam.Close(rs); err != nil {
		return Row{}, fmt.Errorf("outbox: %s: %w", op, err)
	}
	return r, nil
}

// Requeue puts the quarantined row with this id back in the relay's
// stream: its failure record is cleared (failures, permanent failures,
// backoff, quarantine, last error), and the relays of the table are woken
// (they LISTEN for it; otherwise their next poll finds it), so the message
// is published again at once, with its UUID, ahead of the rows written
// after it. Fix the cause first: a row that fails for its own reasons again
// is quarantined again after RelayConfig.MaxAttempts.
//
// Only a quarantined row is requeued. Requeue returns ErrRowNotFound when
// there is no row with this id, and ErrNotQuarantined when the row is not
// quarantined (the relay is still trying it, or another operator requeued it
// first), and ErrChanged when expect no longer holds: nothing is changed
// then. To make failing rows due at once, use RequeueMatching with
// StateFailing. db.Conn is required.
func Requeue(ctx context.Context, db sqlschema.DB, id int64, expect Expect) error {
	const op = "Requeue"
	if err := checkID(op, db, id); err != nil {
		return err
	}
	return actOnQuarantined(ctx, db, op, id, expect, `WITH acted AS (
  UPDATE `+db.Outbox()+` SET `+clearFailures+`
  WHERE id = $1 AND quarantined_at IS NOT NULL RETURNING id
)
SELECT n, (CASE WHEN n > 0 THEN `+outboxnotify.NotifySQL(db)+` END) IS NULL
FROM (SELECT count(*) AS n FROM acted) c`)
}

// Discard deletes the quarantined row with this id: its message is then
// never published (the relay cannot see it any more, and nothing keeps a
// copy). It returns ErrRowNotFound when there is no row with this id, and
// ErrNotQuarantined when the row is not quarantined (the relay may be
// publishing it at this moment; a failing row cannot be discarded), and
// ErrChanged when expect no longer holds: nothing is changed then. db.Conn
// is required.
func Discard(ctx context.Context, db sqlschema.DB, id int64, expect Expect) error {
	const op = "Discard"
	if err := checkID(op, db, id); err != nil {
		return err
	}
	return actOnQuarantined(ctx, db, op, id, expect, `WITH acted AS (
  DELETE FROM `+db.Outbox()+` WHERE id = $1 AND quarantined_at IS NOT NULL RETURNING id
)
SELECT n, true FROM (SELECT count(*) AS n FROM acted) c`)
}

// RequeueMatching requeues (see Requeue) every row that f selects: by
// default the quarantined ones; with StateFailing or StateAll, failing rows
// too, which are then due at once, their failure count and backoff reset.
// The zero RowFilter requeues every quarantined row. It works in batches of
// a few hundred rows, each its own short transaction, and returns the
// number of rows requeued; after an error, the number requeued by the
// batches before it. Rows a relay holds at that moment (it is publishing
// them) are skipped. db.Conn is required.
func RequeueMatching(ctx context.Context, db sqlschema.DB, f RowFilter) (int64, error) {
	const op = "RequeueMatching"
	if err := checkDB(db); err != nil {
		return 0, fmt.Errorf("outbox: %s: %w", op, err)
	}
	if err := f.validate(op); err != nil {
		return 0, err
	}
	return actOnMatching(ctx, db, op, f, func(picked string) string {
		return `UPDATE ` + db.Outbox() + ` o SET ` + clearFailures + ` FROM ` + picked + ` p WHERE o.id = p.id RETURNING o.id`
	}, true)
}

// DiscardMatching deletes every quarantined row that f selects: their
// messages are then never published. f.State must be StateQuarantined (or
// empty): a failing row is still the relay's. f must name at least one
// criterion (to discard every quarantined row on purpose, set AsOf, from
// CountRowsAsOf, or QuarantinedBefore to the current time). It works in batches of a few
// hundred rows, each its own short transaction, and returns the number of
// rows deleted; after an error, the number deleted by the batches before
// it. db.Conn is required.
func DiscardMatching(ctx context.Context, db sqlschema.DB, f RowFilter) (int64, error) {
	const op = "DiscardMatching"
	if err := checkDB(db); err != nil {
		return 0, fmt.Errorf("outbox: %s: %w", op, err)
	}
	if err := f.validate(op); err != nil {
		return 0, err
	}
	if f.State != "" && f.State != StateQuarantined {
		return 0, fmt.Errorf("outbox: %s: RowFilter.State is %q: only quarantined rows can be discarded (a failing row is still the relay's, which may be publishing it)", op, f.State)
	}
	if f.empty() {
		return 0, fmt.Errorf("outbox: %s: the RowFilter selects every quarantined row: name a criterion (to discard them all on purpose, set AsOf from CountRowsAsOf, or QuarantinedBefore to the current time)", op)
	}
	return actOnMatching(ctx, db, op, f, func(picked string) string {
		return `DELETE FROM ` + db.Outbox() + ` o USING ` + picked + ` p WHERE o.id = p.id RETURNING o.id`
	}, false)
}

// findSQL is FindRows' query: up to limit rows that f selects with ids
// above after, in id order.
func findSQL(db sqlschema.DB, f RowFilter, after int64, limit int) (string, []any) {
	where, args := f.where()
	args = append(args, after, limit)
	return `SELECT ` + rowColumns(db.Outbox(), `NULL::bytea`) + ` FROM ` + db.Outbox() + ` o
WHERE ` + where + ` AND id > $` + strconv.Itoa(len(args)-1) + `
ORDER BY id LIMIT $` + strconv.Itoa(len(args)), args
}

// countSQL is CountRows' query: with f.MaxCount, it counts MaxCount+1
// rows at most.
func countSQL(db sqlschema.DB, f RowFilter) (string, []any) {
	where, args := f.where()
	if f.MaxCount > 0 {
		args = append(args, f.MaxCount+1)
		return `SELECT count(*) FROM (SELECT 1 FROM ` + db.Outbox() + ` WHERE ` + where + ` LIMIT $` + strconv.Itoa(len(args)) + `) c`, args
	}
	return `SELECT count(*) FROM ` + db.Outbox() + ` WHERE ` + where, args
}

// clearFailures is the SET list that clears a row's failure record, as
// RequeueFailed does.
const clearFailures = `failures = 0, attempts = 0, next_attempt_at = NULL, quarantined_at = NULL, last_error = NULL`

// rowColumns are the columns scanRow reads, of table read as o, with
// payload (an expression: o.payload, a prefix of it, or NULL) as the
// payload. The payload's size is octet_length, which PostgreSQL answers
// from the stored value's header (a large payload is stored out of line,
// TOAST, and is not read for it). The rows waiting behind a failed row with
// a key are counted on the ordering_key index of outbox_001 (a range of it
// after the row's id).
func rowColumns(table, payload string) string {
	return `o.id, o.topic, o.uuid, ` + payload + `, octet_length(o.payload), o.metadata::text, o.created_at, o.quarantined_at, o.failures, o.attempts, o.next_attempt_at,
  coalesce(o.last_error, ''), coalesce(o.ordering_key, ''),
  CASE WHEN o.ordering_key IS NOT NULL AND o.failures > 0
    THEN (SELECT count(*) FROM ` + table + ` w WHERE w.ordering_key = o.ordering_key AND w.id > o.id) ELSE 0 END`
}

// scanner is the Scan of both drivers' rows.
type scanner interface{ Scan(dest ...any) error }

func scanRow(rs scanner) (Row, error) {
	var r Row
	var meta string
	if err := rs.Scan(&r.ID, &r.Topic, &r.UUID, &r.Payload, &r.PayloadSize, &meta, &r.CreatedAt, &r.QuarantinedAt,
		&r.Failures, &r.PermanentFailures, &r.NextAttemptAt, &r.LastError, &r.OrderingKey, &r.Waiting); err != nil {
		return Row{}, err
	}
	r.RawMetadata = json.RawMessage(meta)
	r.Version = parked.RowVersion(r.ID, r.QuarantinedAt, r.Failures, r.PermanentFailures)
	var m map[string]string
	if json.Unmarshal(r.RawMetadata, &m) == nil {
		r.Metadata = m
	}
	return r, nil
}

func checkID(op string, db sqlschema.DB, id int64) error {
	if err := checkDB(db); err != nil {
		return fmt.Errorf("outbox: %s: %w", op, err)
	}
	if id <= 0 {
		return fmt.Errorf("outbox: %s: row id %d: ids are positive (Row.ID, as FindRows returns it)", op, id)
	}
	return nil
}

// actOnQuarantined runs stmt, which requeues or deletes row id, in one READ
// COMMITTED transaction (whatever the database's default isolation) that
// first locks the row and checks it: that it exists, is quarantined, and,
// when expect names a version, is the failure record the operator was
// shown. The statement then acts on exactly the row that was checked.
func actOnQuarantined(ctx context.Context, db sqlschema.DB, op string, id int64, expect Expect, stmt string) (err error) {
	if len(expect.Version) > 255 {
		return fmt.Errorf("outbox: %s: Expect.Version is not a version a row shows (over 255 bytes)", op)
	}
	if err := parked.CheckRowVersion(expect.Version); err != nil {
		return fmt.Errorf("outbox: %s: %w", op, err)
	}
	tx, err := db.Conn.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("outbox: %s: %w", op, ifNotMigrated(db, err))
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()
	var quarantinedAt *time.Time
	var failures, permanent int
	err = seam.QueryRow(ctx, tx, `SELECT quarantined_at, failures, attempts FROM `+db.Outbox()+` WHERE id = $1 FOR UPDATE`,
		[]any{id}, &quarantinedAt, &failures, &permanent)
	switch {
	case errors.Is(err, seam.ErrNoRows):
		return fmt.Errorf("outbox: %s: row %d: %w", op, id, ErrRowNotFound)
	case err != nil:
		return fmt.Errorf("outbox: %s: %w", op, ifNotMigrated(db, err))
	case quarantinedAt == nil && failures > 0:
		return fmt.Errorf("outbox: %s: row %d: %w: it is failing, and the relay retries it after its backoff", op, id, ErrNotQuarantined)
	case quarantinedAt == nil:
		return fmt.Errorf("outbox: %s: row %d: %w: it has no failure record (the relay publishes it with the live backlog)", op, id, ErrNotQuarantined)
	case expect.Version != "" && parked.RowVersion(id, quarantinedAt, failures, permanent) != expect.Version:
		return fmt.Errorf("outbox: %s: row %d: %w: it is quarantined since %s after %d failures (%d its own), not as shown (version %s)",
			op, id, ErrChanged, quarantinedAt.UTC().Format(time.RFC3339Nano), failures, permanent, expect.Version)
	}
	var n int64
	var ignored bool
	if err = seam.QueryRow(ctx, tx, stmt, []any{id}, &n, &ignored); err != nil {
		return fmt.Errorf("outbox: %s: %w", op, ifNotMigrated(db, err))
	}
	if n != 1 { // cannot happen: the row is locked and quarantined
		err = fmt.Errorf("outbox: %s: row %d changed under its lock", op, id)
		return err
	}
	if err = tx.Commit(); err != nil {
		return fmt.Errorf("outbox: %s: commit: %w", op, err)
	}
	return nil
}

// actOnMatching runs the statement that act builds over batches of the rows
// f selects, in id order, each batch one statement (its own transaction).
// act gets the name of the batch's locked ids and returns a data-modifying
// statement with RETURNING. notify sends the table's NOTIFY with each batch
// that changed a row.
func actOnMatching(ctx context.Context, db sqlschema.DB, op string, f RowFilter, act func(picked string) string, notify bool) (int64, error) {
	where, args := f.where()
	cursor, batch := len(args)+1, len(args)+2
	notice := "true"
	if notify {
		notice = `(CASE WHEN (SELECT count(*) FROM acted) > 0 THEN ` + outboxnotify.NotifySQL(db) + ` END) IS NULL`
	}
	stmt := `WITH picked AS (
  SELECT id FROM ` + db.Outbox() + ` WHERE ` + where + ` AND id > $` + strconv.Itoa(cursor) + `
  ORDER BY id LIMIT $` + strconv.Itoa(batch) + ` FOR UPDATE SKIP LOCKED
), acted AS (` + act("picked") + `)
SELECT (SELECT count(*) FROM acted), (SELECT count(*) FROM picked), (SELECT coalesce(max(id), 0) FROM picked), ` + notice
	var total, after int64
	for {
		var acted, picked, last int64
		var ignored bool
		batchArgs := slices.Concat(args, []any{after, matchingBatch})
		err := seam.QueryRow(ctx, db.Conn, stmt, batchArgs, &acted, &picked, &last, &ignored)
		if err != nil {
			return total, fmt.Errorf("outbox: %s: after %d rows: %w", op, total, ifNotMigrated(db, err))
		}
		total += acted
		if picked < matchingBatch {
			return total, nil
		}
		after = last
	}
}

// validate reports the first field of f that is not valid, naming it.
func (f RowFilter) validate(op string) error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("outbox: %s: RowFilter."+format, append([]any{op}, a...)...)
	}
	switch f.State {
	case "", StateQuarantined, StateFailing, StateAll:
	default:
		return bad("State is %q: want %q (the default), %q or %q", f.State, StateQuarantined, StateFailing, StateAll)
	}
	if len(f.IDs) > MaxFilterIDs {
		return bad("IDs names %d rows, at most %d: act on them in several calls", len(f.IDs), MaxFilterIDs)
	}
	for _, id := range f.IDs {
		if id <= 0 {
			return bad("IDs has %d: ids are positive (Row.ID)", id)
		}
	}
	for _, s := range []struct{ field, value string }{{"Topic", f.Topic}, {"UUID", f.UUID}, {"Reason", f.Reason}, {"OrderingKey", f.OrderingKey}} {
		if err := pgtext.Check(s.value); err != nil {
			return bad("%s %w", s.field, err)
		}
	}
	if f.State == StateFailing && (!f.QuarantinedSince.IsZero() || !f.QuarantinedBefore.IsZero()) {
		return bad("QuarantinedSince/QuarantinedBefore are set with State %q: failing rows are not quarantined, so none would match", StateFailing)
	}
	if !f.QuarantinedSince.IsZero() && !f.QuarantinedBefore.IsZero() && !f.QuarantinedSince.Before(f.QuarantinedBefore) {
		return bad("QuarantinedSince (%s) is not before QuarantinedBefore (%s): the range is empty",
			f.QuarantinedSince.Format(time.RFC3339Nano), f.QuarantinedBefore.Format(time.RFC3339Nano))
	}
	if f.MaxID < 0 {
		return bad("MaxID is %d: ids are positive (RowCount.MaxID; 0 for no bound)", f.MaxID)
	}
	if f.MaxScan < 0 || f.MaxCount < 0 {
		return bad("MaxScan (%d) and MaxCount (%d) are bounds: 0 (none) or positive", f.MaxScan, f.MaxCount)
	}
	for k, v := range f.Metadata {
		if k == "" {
			return bad("Metadata has an empty key")
		}
		if err := pgtext.Check(k); err != nil {
			return bad("Metadata key %q %w", k, err)
		}
		if err := pgtext.Check(v); err != nil {
			return bad("Metadata[%q]: value %w", k, err)
		}
	}
	return nil
}

// empty reports whether f names no criterion besides its state.
func (f RowFilter) empty() bool {
	return len(f.IDs) == 0 && f.Topic == "" && f.UUID == "" && f.Reason == "" && f.OrderingKey == "" &&
		f.QuarantinedSince.IsZero() && f.QuarantinedBefore.IsZero() && len(f.Metadata) == 0 && f.AsOf.IsZero() && f.MaxID == 0
}

// where returns f as an SQL condition and its arguments ($1, $2...): only
// the criteria set, each in the form the partial indexes of outbox_001
// (failing, quarantined_*, ordering_key) serve. f must be valid.
func (f RowFilter) where() (string, []any) {
	var conds []string
	var args []any
	arg := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args))
	}
	switch f.State {
	case StateFailing:
		conds = append(conds, `failures > 0 AND quarantined_at IS NULL`)
	case StateAll:
		// Each arm the predicate of a partial index (a BitmapOr of both).
		conds = append(conds, `(quarantined_at IS NOT NULL OR (failures > 0 AND quarantined_at IS NULL))`)
	default:
		conds = append(conds, `quarantined_at IS NOT NULL`)
	}
	if len(f.IDs) > 0 {
		conds = append(conds, `id = ANY(`+arg(f.IDs)+`::bigint[])`)
	}
	if f.Topic != "" {
		conds = append(conds, `topic = `+arg(f.Topic))
	}
	if f.UUID != "" {
		conds = append(conds, `uuid = `+arg(f.UUID))
	}
	if f.Reason != "" {
		conds = append(conds, `strpos(lower(last_error), lower(`+arg(f.Reason)+`)) > 0`)
	}
	if f.OrderingKey != "" {
		conds = append(conds, `ordering_key = `+arg(f.OrderingKey))
	}
	if !f.QuarantinedSince.IsZero() {
		conds = append(conds, `quarantined_at >= `+arg(f.QuarantinedSince))
	}
	if !f.QuarantinedBefore.IsZero() {
		conds = append(conds, `quarantined_at < `+arg(f.QuarantinedBefore))
	}
	if len(f.Metadata) > 0 {
		js, _ := json.Marshal(f.Metadata) // a map of strings always encodes
		conds = append(conds, `metadata @> `+arg(string(js))+`::jsonb`)
	}
	if f.MaxID > 0 {
		conds = append(conds, `id <= `+arg(f.MaxID))
	}
	if !f.AsOf.IsZero() {
		switch f.State {
		case StateFailing: // no time of their failure: MaxID bounds them
		case StateAll:
			conds = append(conds, `(quarantined_at IS NULL OR quarantined_at <= `+arg(f.AsOf)+`)`)
		default:
			conds = append(conds, `quarantined_at <= `+arg(f.AsOf))
		}
	}
	return strings.Join(conds, " AND "), args
}
