package outbox

import (
	"context"
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
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
// (Store.GetPrefix); requeue it (the relay sends it again at once) or discard it
// (it is never published), one by one or every row a filter selects.
// Searches of quarantined rows use the partial quarantined_* indexes of
// migration outbox_001, which hold quarantined rows only: measured on
// 50,000 rows of which 1,000 quarantined, a search by a metadata field or a
// UUID takes under 0.1 ms (a sequential scan of 8-14 ms without them).
// On MySQL/MariaDB (sqlschema.MySQL) the operations mean the same; the
// quarantine indexes there cover every row (MySQL has no partial index),
// and a requeued row is found by the relays' next poll (no NOTIFY).

var (
	// ErrRowNotFound is returned (wrapped) by Store.Get, Requeue and Discard
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
	// ErrTooBroad is returned (wrapped) by Store.Find, Count and
	// CountAsOf for a filter whose read would exceed its bound
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
	// never failed (the live backlog, which Store.Pending counts) are never
	// selected.
	StateAll RowState = "all"
)

// Limits of the Store's operations.
const (
	// DefaultRowLimit is the page size of Store.Find when Page.Limit is 0.
	DefaultRowLimit = 100
	// MaxRowLimit is the largest Page.Limit.
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
	// Payload is the message's payload: all of it from Store.Get, at most
	// its first bytes from Store.GetPrefix, and nil in Store.Find's pages, which
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

	// MaxScan, when positive, bounds the work of Store.Find, Count and
	// CountAsOf for a filter that Scans (Reason: no index holds the
	// error's text): they are refused (ErrTooBroad) when the other
	// conditions select more than MaxScan rows to check it on, and
	// otherwise read only those (counted on the indexes first, in the same
	// snapshot). Defaults to 0: no bound. RequeueMatching and
	// DiscardMatching ignore it (count first).
	MaxScan int
	// MaxCount, when positive, bounds Store.Count and CountAsOf: a count
	// of more than MaxCount rows is refused (ErrTooBroad); they count at
	// most MaxCount+1. Defaults to 0: no bound.
	MaxCount int

	// AsOf and MaxID bound the rows to those a count could see
	// (Store.CountAsOf returns both): give them to RequeueMatching or
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
// (Store.CountAsOf).
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

// Page is a page of Store.Find: rows oldest (lowest id) first, as
// inbox.Page is a page of parked messages.
type Page struct {
	// Limit is the page's size. Defaults to DefaultRowLimit; at most
	// MaxRowLimit.
	Limit int
	// After is the previous page's RowPage.Next, to read the page after
	// it; "" reads the first page. Pages follow the rows' ids: a row
	// relayed, requeued or discarded between two pages is not shown twice,
	// and a row that fails (or is quarantined) after the first page was
	// read comes on a later page only if its id is above the cursor.
	After string
}

// RowPage is a page of outbox rows.
type RowPage struct {
	// Rows are the page's rows, in id order.
	Rows []Row
	// Next is the cursor of the page after this one (Page.After); "" when
	// this is the last page.
	Next string
}

// cursor decodes Page.After: the id of the previous page's last row.
func cursor(after string) (int64, error) {
	if after == "" {
		return 0, nil
	}
	id, err := strconv.ParseInt(after, 10, 64)
	if err != nil || id <= 0 {
		return 0, fmt.Errorf("Page.After is %q: use \"\" for the first page, RowPage.Next for the next", after)
	}
	return id, nil
}

// Store is the operator's view of one outbox table: find and count the
// rows the relay quarantined or is retrying (Find, Count, CountAsOf),
// read one (Get, GetPrefix), requeue or discard them one by one (Requeue,
// Discard) or by filter (RequeueMatching, DiscardMatching), and the
// backlog (Pending, RequeueFailed). Its statements are rendered once, by
// NewStore. Safe for concurrent use.
type Store struct {
	db sqlschema.DB
	st *outboxdb.Store
}

// NewStore returns a Store for db's outbox table. db.Conn is required; the
// table must exist (sqlschema.Migrate). It does not touch the database.
func NewStore(db sqlschema.DB) (*Store, error) {
	if err := checkDB(db); err != nil {
		return nil, fmt.Errorf("outbox: NewStore: %w", err)
	}
	st, err := outboxdb.New(db)
	if err != nil {
		return nil, fmt.Errorf("outbox: NewStore: %w", err)
	}
	return &Store{db: db, st: st}, nil
}

// fail is err as the Store's operation op returns it: with the
// not-migrated hint when the table (or a column) is missing.
func (s *Store) fail(op string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("outbox: %s: %w", op, ifNotMigrated(s.db, err))
}

// Find returns a page of the rows that f selects (by default the
// quarantined ones), oldest first, without their payloads (Row.Payload is
// nil; Row.PayloadSize is the payload's size): the rows the relay
// quarantines are often those whose payload is too large for the broker,
// and a page of them would weigh what their payloads weigh. Read one
// row's payload with Get or GetPrefix. RowPage.Next reads the next page.
func (s *Store) Find(ctx context.Context, f RowFilter, p Page) (RowPage, error) {
	const op = "Find"
	if err := f.validate(op); err != nil {
		return RowPage{}, err
	}
	after, err := cursor(p.After)
	if err != nil {
		return RowPage{}, fmt.Errorf("outbox: %s: %w", op, err)
	}
	if p.Limit < 0 || p.Limit > MaxRowLimit {
		return RowPage{}, fmt.Errorf("outbox: %s: Page.Limit is %d: it must be between 1 and %d (0 for %d)", op, p.Limit, MaxRowLimit, DefaultRowLimit)
	}
	limit := p.Limit
	if limit == 0 {
		limit = DefaultRowLimit
	}
	var rows []outboxdb.Row
	err = s.boundedRead(ctx, f, func(conn wsql.ContextExecutor) error {
		var err error
		rows, err = s.st.FindRows(ctx, conn, f.internal(), after, limit+1)
		return err
	})
	if err != nil {
		return RowPage{}, s.fail(op, err)
	}
	var page RowPage
	if len(rows) > limit {
		rows = rows[:limit]
		page.Next = strconv.FormatInt(rows[limit-1].ID, 10)
	}
	page.Rows = make([]Row, len(rows))
	for i, r := range rows {
		page.Rows[i] = rowOf(r)
	}
	return page, nil
}

// Count returns the number of rows that f selects (by default the
// quarantined ones). To confirm a count before RequeueMatching or
// DiscardMatching, use CountAsOf: the action then acts on no row the
// count did not see.
func (s *Store) Count(ctx context.Context, f RowFilter) (int64, error) {
	const op = "Count"
	if err := f.validate(op); err != nil {
		return 0, err
	}
	var n int64
	err := s.boundedRead(ctx, f, func(conn wsql.ContextExecutor) error {
		var err error
		if n, _, err = s.st.CountRows(ctx, conn, f.internal(), f.countBound()); err != nil {
			return err
		}
		return f.checkCount(n)
	})
	if err != nil {
		return 0, s.fail(op, err)
	}
	return n, nil
}

// CountAsOf counts as Count does, at the database's current time (or at
// f.AsOf when it is set), and returns the bounds of what it counted: the
// time (RowCount.AsOf) and the largest id (RowCount.MaxID). Count, have
// the count confirmed, then act with f.AsOf and f.MaxID set to them:
// RequeueMatching and DiscardMatching then act on rows the count saw,
// never on one quarantined or written after it. Count again with the
// bounds just before acting, to check that the confirmed count still holds
// (a row requeued, relayed or discarded meanwhile drops out). One window
// remains: a row the relay quarantined (its time stamped by the relay's
// statement, before AsOf) in a transaction that committed after the count
// read the table was not counted, and, when its id is below MaxID, is
// within the bounds; the window is the relay's commit after that
// statement.
func (s *Store) CountAsOf(ctx context.Context, f RowFilter) (RowCount, error) {
	const op = "CountAsOf"
	if err := f.validate(op); err != nil {
		return RowCount{}, err
	}
	if f.AsOf.IsZero() {
		now, err := s.st.Now(ctx, s.db.Conn)
		if err != nil {
			return RowCount{}, s.fail(op, err)
		}
		f.AsOf = now
	}
	c := RowCount{AsOf: f.AsOf}
	err := s.boundedRead(ctx, f, func(conn wsql.ContextExecutor) error {
		var err error
		// With MaxCount, MaxCount+1 rows at most: enough to refuse; a
		// count within the bound read them all, and its max(id) is
		// theirs.
		if c.Count, c.MaxID, err = s.st.CountRows(ctx, conn, f.internal(), f.countBound()); err != nil {
			return err
		}
		return f.checkCount(c.Count)
	})
	if err != nil {
		return RowCount{}, s.fail(op, err)
	}
	return c, nil
}

// countBound is the most rows a count of f reads: MaxCount+1 with a
// MaxCount, else 0 (no bound).
func (f RowFilter) countBound() int {
	if f.MaxCount > 0 {
		return f.MaxCount + 1
	}
	return 0
}

// Scans reports whether f has a condition no index serves, which a read
// checks on each row its other conditions select: Reason (the last
// error's text). Bound such a read with MaxScan where one caller's
// request must not read every failed row (a console, an API).
func (f RowFilter) Scans() bool { return f.Reason != "" }

// checkCount refuses a count over f.MaxCount (counted up to MaxCount+1).
func (f RowFilter) checkCount(n int64) error {
	if f.MaxCount > 0 && n > int64(f.MaxCount) {
		return fmt.Errorf("%w: more than %d rows match (MaxCount)",
			ErrTooBroad, f.MaxCount)
	}
	return nil
}

// boundedRead runs read (a find or count of f); for a filter with MaxScan
// that Scans, in a read-only REPEATABLE READ transaction that first
// counts, on the indexes (no sequential scan), the rows f's other
// conditions select (up to MaxScan+1) and refuses when there are more than
// MaxScan (ErrTooBroad), then plans the read through those indexes'
// bitmaps, not by a sequential scan of the table nor a walk of an index in
// its order (a random read per row), as the inbox's parked messages are
// read (inboxdb.Store.BoundedScan): the check and the read see the same
// rows, and the read's work is bounded by MaxScan. MySQL has no planner
// settings to force that plan: there the check is the same, in the same
// snapshot, and the optimizer, which estimates the indexed conditions on
// the statement's own values, reads through the indexes a selection the
// check just proved small (outboxdb.Store.BoundedScan).
func (s *Store) boundedRead(ctx context.Context, f RowFilter, read func(conn wsql.ContextExecutor) error) error {
	if f.MaxScan <= 0 || !f.Scans() {
		return read(s.db.Conn)
	}
	tx, err := s.db.Conn.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelRepeatableRead, ReadOnly: true})
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }() // read-only: nothing to keep
	n, err := s.st.BoundedScan(ctx, tx, f.internal(), f.MaxScan+1)
	if err != nil {
		return err
	}
	if n > int64(f.MaxScan) {
		return fmt.Errorf("%w: the last error's text (Reason), which no index serves, would be checked on more than %d rows (MaxScan)", ErrTooBroad, f.MaxScan)
	}
	return read(tx)
}

// Get returns the row with this id with its whole payload, whatever its
// state (Row.Quarantined, Row.Failures tell it), or ErrRowNotFound. A
// row's payload can be as large as the broker refused (a quarantined
// row's often is): to show a row, GetPrefix reads a bounded part of it.
func (s *Store) Get(ctx context.Context, id int64) (Row, error) {
	return s.get(ctx, "Get", id, -1)
}

// GetPrefix is Get with at most the first maxPayload bytes of the row's
// payload in Row.Payload (Row.PayloadSize is the whole payload's size: the
// payload is cut when it is larger). The database reads and sends that
// prefix only (substring of the stored value), so that showing a row costs
// the same whatever its payload's size (on MySQL, InnoDB reads the stored
// value to cut it, and sends the prefix only). maxPayload is at least 0 (0 reads
// no payload).
func (s *Store) GetPrefix(ctx context.Context, id int64, maxPayload int) (Row, error) {
	const op = "GetPrefix"
	if maxPayload < 0 {
		return Row{}, fmt.Errorf("outbox: %s: maxPayload is %d: the most bytes of the payload to read, at least 0", op, maxPayload)
	}
	return s.get(ctx, op, id, maxPayload)
}

// get reads row id with at most maxPayload bytes of its payload (all of
// it when negative).
func (s *Store) get(ctx context.Context, op string, id int64, maxPayload int) (Row, error) {
	if err := checkID(op, id); err != nil {
		return Row{}, err
	}
	r, found, err := s.st.GetRow(ctx, s.db.Conn, id, maxPayload)
	if err != nil {
		return Row{}, s.fail(op, err)
	}
	if !found {
		return Row{}, fmt.Errorf("outbox: %s: row %d: %w", op, id, ErrRowNotFound)
	}
	return rowOf(r), nil
}

// Requeue puts the quarantined row with this id back in the relay's
// stream: its failure record is cleared (failures, permanent failures,
// backoff, quarantine, last error), and the relays of the table are woken
// (they LISTEN for it; otherwise, and on MySQL, which has no NOTIFY,
// their next poll finds it), so the message
// is published again at once, with its UUID, ahead of the rows written
// after it. Fix the cause first: a row that fails for its own reasons again
// is quarantined again after RelayConfig.MaxAttempts.
//
// Only a quarantined row is requeued. Requeue returns ErrRowNotFound when
// there is no row with this id, and ErrNotQuarantined when the row is not
// quarantined (the relay is still trying it, or another operator requeued it
// first), and ErrChanged when expect no longer holds: nothing is changed
// then. To make failing rows due at once, use RequeueMatching with
// StateFailing.
func (s *Store) Requeue(ctx context.Context, id int64, expect Expect) error {
	return s.actOnQuarantined(ctx, "Requeue", id, expect, s.st.RequeueRow)
}

// Discard deletes the quarantined row with this id: its message is then
// never published (the relay cannot see it any more, and nothing keeps a
// copy). It returns ErrRowNotFound when there is no row with this id, and
// ErrNotQuarantined when the row is not quarantined (the relay may be
// publishing it at this moment; a failing row cannot be discarded), and
// ErrChanged when expect no longer holds: nothing is changed then.
func (s *Store) Discard(ctx context.Context, id int64, expect Expect) error {
	return s.actOnQuarantined(ctx, "Discard", id, expect, s.st.DiscardRow)
}

// RequeueMatching requeues (see Requeue) every row that f selects: by
// default the quarantined ones; with StateFailing or StateAll, failing rows
// too, which are then due at once, their failure count and backoff reset.
// The zero RowFilter requeues every quarantined row. It works in batches of
// a few hundred rows, each its own short transaction, and returns the
// number of rows requeued; after an error, the number requeued by the
// batches before it. Rows a relay holds at that moment (it is publishing
// them) are skipped.
func (s *Store) RequeueMatching(ctx context.Context, f RowFilter) (int64, error) {
	const op = "RequeueMatching"
	if err := f.validate(op); err != nil {
		return 0, err
	}
	return s.actOnMatching(ctx, op, f, s.st.RequeueMatching)
}

// DiscardMatching deletes every quarantined row that f selects: their
// messages are then never published. f.State must be StateQuarantined (or
// empty): a failing row is still the relay's. f must name at least one
// criterion (to discard every quarantined row on purpose, set AsOf, from
// CountAsOf, or QuarantinedBefore to the current time). It works in
// batches of a few hundred rows, each its own short transaction, and
// returns the number of rows deleted; after an error, the number deleted
// by the batches before it.
func (s *Store) DiscardMatching(ctx context.Context, f RowFilter) (int64, error) {
	const op = "DiscardMatching"
	if err := f.validate(op); err != nil {
		return 0, err
	}
	if f.State != "" && f.State != StateQuarantined {
		return 0, fmt.Errorf("outbox: %s: RowFilter.State is %q, but only quarantined rows can be discarded", op, f.State)
	}
	if f.empty() {
		return 0, fmt.Errorf("outbox: %s: the RowFilter names no criterion and AsOf is not set, so it selects every quarantined row", op)
	}
	return s.actOnMatching(ctx, op, f, s.st.DiscardMatching)
}

// rowOf is the operator's Row of a row read by outboxdb.
func rowOf(r outboxdb.Row) Row {
	out := Row{
		ID: r.ID, Topic: r.Topic, UUID: r.UUID, Payload: r.Payload, PayloadSize: r.PayloadSize,
		RawMetadata: json.RawMessage(r.Metadata), CreatedAt: r.CreatedAt, QuarantinedAt: r.QuarantinedAt,
		Failures: r.Failures, PermanentFailures: r.PermanentFailures, NextAttemptAt: r.NextAttemptAt,
		LastError: r.LastError, OrderingKey: r.OrderingKey, Waiting: r.Waiting,
	}
	out.Version = parked.RowVersion(out.ID, out.QuarantinedAt, out.Failures, out.PermanentFailures)
	var m map[string]string
	if json.Unmarshal(out.RawMetadata, &m) == nil {
		out.Metadata = m
	}
	return out
}

func checkID(op string, id int64) error {
	if id <= 0 {
		return fmt.Errorf("outbox: %s: row id %d: ids are positive (Row.ID, as Store.Find returns it)", op, id)
	}
	return nil
}

// actOnQuarantined runs act, which requeues or deletes row id, in one READ
// COMMITTED transaction (whatever the database's default isolation) that
// first locks the row and checks it: that it exists, is quarantined, and,
// when expect names a version, is the failure record the operator was
// shown. act then acts on exactly the row that was checked.
func (s *Store) actOnQuarantined(ctx context.Context, op string, id int64, expect Expect,
	act func(ctx context.Context, tx wsql.ContextExecutor, id int64) (int64, error),
) (err error) {
	if err := checkID(op, id); err != nil {
		return err
	}
	if len(expect.Version) > 255 {
		return fmt.Errorf("outbox: %s: Expect.Version is not a version a row shows (over 255 bytes)", op)
	}
	if err := parked.CheckRowVersion(expect.Version); err != nil {
		return fmt.Errorf("outbox: %s: %w", op, err)
	}
	tx, err := s.db.Conn.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return s.fail(op, err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()
	quarantinedAt, failures, permanent, err := s.st.LockRow(ctx, tx, id)
	switch {
	case errors.Is(err, seam.ErrNoRows):
		return fmt.Errorf("outbox: %s: row %d: %w", op, id, ErrRowNotFound)
	case err != nil:
		return s.fail(op, err)
	case quarantinedAt == nil && failures > 0:
		return fmt.Errorf("outbox: %s: row %d: %w: it is failing, and the relay retries it after its backoff", op, id, ErrNotQuarantined)
	case quarantinedAt == nil:
		return fmt.Errorf("outbox: %s: row %d: %w: it has no failure record (the relay publishes it with the live backlog)", op, id, ErrNotQuarantined)
	case expect.Version != "" && parked.RowVersion(id, quarantinedAt, failures, permanent) != expect.Version:
		return fmt.Errorf("outbox: %s: row %d: %w: it is quarantined since %s after %d failures (%d its own), not as shown (version %s)",
			op, id, ErrChanged, quarantinedAt.UTC().Format(time.RFC3339Nano), failures, permanent, expect.Version)
	}
	n, err := act(ctx, tx, id)
	if err != nil {
		return s.fail(op, err)
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

// actOnMatching runs act over batches of the rows f selects, in id order,
// each batch one statement (its own transaction), until a batch picks
// fewer than matchingBatch rows.
func (s *Store) actOnMatching(ctx context.Context, op string, f RowFilter,
	act func(ctx context.Context, q wsql.ContextExecutor, f outboxdb.Filter, after int64, limit int) (outboxdb.Matched, error),
) (int64, error) {
	filter := f.internal()
	var total, after int64
	for {
		m, err := s.matchingBatch(ctx, filter, after, act)
		if err != nil {
			return total, fmt.Errorf("outbox: %s: after %d rows: %w", op, total, ifNotMigrated(s.db, err))
		}
		total += m.Acted
		if m.Picked < matchingBatch {
			return total, nil
		}
		after = m.Last
	}
}

// matchingBatch runs one batch of act: on PostgreSQL one statement on the
// pool; on MySQL, where locking the rows and changing them are two
// statements, in a READ COMMITTED transaction of its own (whatever the
// server's default isolation: InnoDB then locks only the rows that
// match), committed here.
func (s *Store) matchingBatch(ctx context.Context, filter outboxdb.Filter, after int64,
	act func(ctx context.Context, q wsql.ContextExecutor, f outboxdb.Filter, after int64, limit int) (outboxdb.Matched, error),
) (m outboxdb.Matched, err error) {
	if !s.st.NeedsTx() {
		return act(ctx, s.db.Conn, filter, after, matchingBatch)
	}
	tx, err := s.db.Conn.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return m, err
	}
	if m, err = act(ctx, tx, filter, after, matchingBatch); err != nil {
		_ = tx.Rollback()
		return outboxdb.Matched{}, err
	}
	if err := tx.Commit(); err != nil {
		return outboxdb.Matched{}, fmt.Errorf("commit: %w", err)
	}
	return m, nil
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

// internal is f as the storage layer's filter (f is valid).
func (f RowFilter) internal() outboxdb.Filter {
	return outboxdb.Filter{
		State: string(f.State), IDs: f.IDs, Topic: f.Topic, UUID: f.UUID, Reason: f.Reason, OrderingKey: f.OrderingKey,
		QuarantinedSince: f.QuarantinedSince, QuarantinedBefore: f.QuarantinedBefore, Metadata: f.Metadata,
		MaxID: f.MaxID, AsOf: f.AsOf,
	}
}
