package outboxdb

import (
	"context"
	"encoding/json"
	"math"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The states of Filter.State.
const (
	StateQuarantined = "quarantined"
	StateFailing     = "failing"
	StateAll         = "all"
)

// Filter selects rows by their failure record (package outbox's
// RowFilter, checked by its caller). A zero field matches every row.
type Filter struct {
	State             string // StateQuarantined, StateFailing or StateAll; "" is StateQuarantined
	IDs               []int64
	Topic             string
	UUID              string
	Reason            string // a part of the last error, ignoring case
	OrderingKey       string
	QuarantinedSince  time.Time
	QuarantinedBefore time.Time
	Metadata          map[string]string // fields the row's metadata has, with these values
	MaxID             int64
	AsOf              time.Time
}

// args are the filter's parameters in dialect d: on PostgreSQL $1 to $10
// of the statements of rows/*.sql (include/row_filter.sql), NULL for a
// field not set; on MySQL, whose `?` cannot be named twice, the same ten
// values each twice in a row (the NULL test and the condition), the ids as
// a JSON array.
func (f Filter) args(d sqlschema.Dialect) []any {
	var ids any
	if len(f.IDs) > 0 {
		ids = f.IDs
		if d == sqlschema.MySQL {
			js, _ := json.Marshal(f.IDs) // a slice of integers always encodes
			ids = string(js)
		}
	}
	var metadata any
	if len(f.Metadata) > 0 {
		js, _ := json.Marshal(f.Metadata) // a map of strings always encodes
		metadata = string(js)
	}
	args := []any{ids, text(f.Topic), text(f.UUID), text(f.Reason), text(f.OrderingKey),
		stamp(f.QuarantinedSince), stamp(f.QuarantinedBefore), metadata, positive(f.MaxID), stamp(f.AsOf)}
	if d != sqlschema.MySQL {
		return args
	}
	twice := make([]any, 0, 2*len(args))
	for _, a := range args {
		twice = append(twice, a, a)
	}
	return twice
}

// query is the statement called name of f's state.
func (s *Store) query(name string, f Filter) string {
	state := f.State
	if state == "" {
		state = StateQuarantined
	}
	st, ok := s.rows[state]
	if !ok {
		panic("outboxdb: no filter state " + state)
	}
	return st.Get(name)
}

// FindRowsQuery is FindRows' statement for f and its arguments (the plan
// tests EXPLAIN it).
func (s *Store) FindRowsQuery(f Filter, after int64, limit int) (string, []any) {
	return s.query("FindRows", f), append(f.args(s.dialect), after, limit)
}

// CountRowsQuery is CountRows' statement for f and its arguments (the plan
// tests EXPLAIN it).
func (s *Store) CountRowsQuery(f Filter, limit int) (string, []any) {
	var bound any
	switch {
	case limit > 0:
		bound = limit
	case s.dialect == sqlschema.MySQL:
		bound = int64(math.MaxInt64) // MySQL has no LIMIT NULL
	}
	return s.query("CountRows", f), append(f.args(s.dialect), bound)
}

func text(s string) any {
	if s == "" {
		return nil
	}
	return s
}

func stamp(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

func positive(n int64) any {
	if n <= 0 {
		return nil
	}
	return n
}

// Row is an outbox row as FindRows (rows/filtered.sql) and GetRow
// (row.sql) read it.
type Row struct {
	ID                int64
	Topic             string
	UUID              string
	Payload           []byte
	PayloadSize       int
	Metadata          string // JSON, as stored
	CreatedAt         time.Time
	QuarantinedAt     *time.Time
	Failures          int
	PermanentFailures int
	NextAttemptAt     *time.Time
	LastError         string
	OrderingKey       string
	Waiting           int64
}

type scanner interface{ Scan(dest ...any) error }

func scanRow(rs scanner) (Row, error) {
	var r Row
	err := rs.Scan(&r.ID, &r.Topic, &r.UUID, &r.Payload, &r.PayloadSize, &r.Metadata, &r.CreatedAt, &r.QuarantinedAt,
		&r.Failures, &r.PermanentFailures, &r.NextAttemptAt, &r.LastError, &r.OrderingKey, &r.Waiting)
	return r, err
}

// FindRows returns at most limit rows that f selects with ids above
// after, in id order, without their payloads.
func (s *Store) FindRows(ctx context.Context, q wsql.ContextExecutor, f Filter, after int64, limit int) ([]Row, error) {
	query, args := s.FindRowsQuery(f, after, limit)
	rs, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	var out []Row
	for rs.Next() {
		r, err := scanRow(rs)
		if err != nil {
			_ = rs.Close()
			return nil, err
		}
		out = append(out, r)
	}
	return out, seam.Close(rs)
}

// GetRow returns row id with at most maxPayload bytes of its payload (all
// of it when maxPayload is negative); found is false when there is no
// such row.
func (s *Store) GetRow(ctx context.Context, q wsql.ContextExecutor, id int64, maxPayload int) (r Row, found bool, err error) {
	var prefix any
	if maxPayload >= 0 {
		prefix = maxPayload
	}
	args := []any{id, prefix}
	if s.dialect == sqlschema.MySQL {
		args = []any{prefix, prefix, id}
	}
	rs, err := q.QueryContext(ctx, s.st.Get("GetRow"), args...)
	if err != nil {
		return Row{}, false, err
	}
	if !rs.Next() {
		return Row{}, false, seam.Close(rs)
	}
	if r, err = scanRow(rs); err != nil {
		_ = rs.Close()
		return Row{}, false, err
	}
	return r, true, seam.Close(rs)
}

// CountRows counts the rows f selects, at most limit of them when limit is
// positive, and returns the largest id among them (0 when none).
func (s *Store) CountRows(ctx context.Context, q wsql.ContextExecutor, f Filter, limit int) (n, maxID int64, err error) {
	query, args := s.CountRowsQuery(f, limit)
	err = seam.QueryRow(ctx, q, query, args, &n, &maxID)
	return n, maxID, err
}

// Now returns the database's time.
func (s *Store) Now(ctx context.Context, q wsql.ContextExecutor) (time.Time, error) {
	var t time.Time
	err := seam.QueryRow(ctx, q, s.st.Get("Now"), nil, &t)
	return t, err
}

// BoundedScan prepares tx, a read-only transaction, for a read of f whose
// Reason no index serves, and returns the number of rows (up to limit)
// f's other conditions select, counted in tx's snapshot. On PostgreSQL it
// turns sequential scans and JIT off, counts on the indexes, and then
// turns index scans off, so that the read after it goes through the
// indexes' bitmaps. MySQL has no such per-transaction planner settings
// (nor a row bound of a statement; MariaDB's max_statement_time bounds its
// time, not its rows, and MySQL 8 names it otherwise): the count is the
// whole of it there. Its bound holds all the same: the optimizer estimates
// the indexed conditions with index dives on the statement's own values,
// and a read that the count just proved selects at most limit rows on
// them takes those indexes.
func (s *Store) BoundedScan(ctx context.Context, tx wsql.ContextExecutor, f Filter, limit int) (int64, error) {
	f.Reason = ""
	var n int64
	if s.dialect == sqlschema.MySQL {
		err := seam.QueryRow(ctx, tx, s.query("BoundedScanCount", f), append(f.args(s.dialect), limit), &n)
		return n, err
	}
	var a, b string
	if err := seam.QueryRow(ctx, tx, s.st.Get("BoundedScanSettings"), nil, &a, &b); err != nil {
		return 0, err
	}
	err := seam.QueryRow(ctx, tx, s.query("BoundedScanCount", f), append(f.args(s.dialect), limit), &n, &a)
	return n, err
}

// LockRow locks row id in tx and returns its failure record, or
// seam.ErrNoRows.
func (s *Store) LockRow(ctx context.Context, tx wsql.ContextExecutor, id int64) (quarantinedAt *time.Time, failures, permanent int, err error) {
	err = seam.QueryRow(ctx, tx, s.st.Get("LockRow"), []any{id}, &quarantinedAt, &failures, &permanent)
	return quarantinedAt, failures, permanent, err
}

// RequeueRow clears the failure record of the quarantined row id, waking
// the relays (at commit; on MySQL, which has no NOTIFY, their next poll
// finds it), and returns the number of rows changed. On MySQL tx must
// hold the row's lock (LockRow): the row then changes whenever it is
// quarantined, and rows affected counts it.
func (s *Store) RequeueRow(ctx context.Context, tx wsql.ContextExecutor, id int64) (int64, error) {
	return s.actOnRow(ctx, tx, "RequeueRow", id)
}

// DiscardRow deletes the quarantined row id and returns the number of
// rows deleted.
func (s *Store) DiscardRow(ctx context.Context, tx wsql.ContextExecutor, id int64) (int64, error) {
	return s.actOnRow(ctx, tx, "DiscardRow", id)
}

func (s *Store) actOnRow(ctx context.Context, tx wsql.ContextExecutor, name string, id int64) (int64, error) {
	if s.dialect == sqlschema.MySQL {
		return seam.Exec(ctx, tx, s.st.Get(name), id)
	}
	var n int64
	var ignored bool
	err := seam.QueryRow(ctx, tx, s.st.Get(name), []any{id}, &n, &ignored)
	return n, err
}

// Matched is what one batch of RequeueMatching or DiscardMatching did.
type Matched struct {
	Acted  int64 // rows changed
	Picked int64 // rows picked (locked)
	Last   int64 // the largest id picked: the next batch's after
}

// RequeueMatching clears the failure records of at most limit rows f
// selects with ids above after, in id order, skipping the rows another
// transaction holds, and wakes the relays when it changed one. On
// PostgreSQL it is one statement, and q may be a pool; on MySQL two (lock
// the rows, then change them), and q must be a transaction (NeedsTx),
// which the caller commits.
func (s *Store) RequeueMatching(ctx context.Context, q wsql.ContextExecutor, f Filter, after int64, limit int) (Matched, error) {
	return s.actOnMatching(ctx, q, "RequeueMatching", f, after, limit)
}

// DiscardMatching is RequeueMatching deleting the rows.
func (s *Store) DiscardMatching(ctx context.Context, q wsql.ContextExecutor, f Filter, after int64, limit int) (Matched, error) {
	return s.actOnMatching(ctx, q, "DiscardMatching", f, after, limit)
}

func (s *Store) actOnMatching(ctx context.Context, q wsql.ContextExecutor, name string, f Filter, after int64, limit int) (Matched, error) {
	var m Matched
	if s.dialect == sqlschema.MySQL {
		return s.actOnMatchingMySQL(ctx, q, name, f, after, limit)
	}
	var ignored bool
	err := seam.QueryRow(ctx, q, s.query(name, f), append(f.args(s.dialect), after, limit), &m.Acted, &m.Picked, &m.Last, &ignored)
	return m, err
}

// actOnMatchingMySQL is actOnMatching in the transaction tx: it locks the
// batch's rows (PickMatching, skipping the rows other transactions hold),
// then requeues or deletes exactly those (RequeuePicked, DiscardPicked),
// which nobody else can change meanwhile: each changes, and rows affected
// counts them.
func (s *Store) actOnMatchingMySQL(ctx context.Context, tx wsql.ContextExecutor, name string, f Filter, after int64, limit int) (Matched, error) {
	var m Matched
	rs, err := tx.QueryContext(ctx, s.query("PickMatching", f), append(f.args(s.dialect), after, limit)...)
	if err != nil {
		return m, err
	}
	var ids []int64
	for rs.Next() {
		var id int64
		if err := rs.Scan(&id); err != nil {
			_ = rs.Close()
			return m, err
		}
		ids = append(ids, id)
	}
	if err := seam.Close(rs); err != nil {
		return m, err
	}
	if len(ids) == 0 {
		return m, nil
	}
	m.Picked, m.Last = int64(len(ids)), ids[len(ids)-1] // in id order
	js, _ := json.Marshal(ids)                          // a slice of integers always encodes
	picked := map[string]string{"RequeueMatching": "RequeuePicked", "DiscardMatching": "DiscardPicked"}[name]
	m.Acted, err = seam.Exec(ctx, tx, s.st.Get(picked), string(js))
	return m, err
}

// NeedsTx reports whether RequeueMatching and DiscardMatching must run in
// a transaction the caller begins and commits (MySQL), rather than on any
// executor (PostgreSQL: one statement).
func (s *Store) NeedsTx() bool { return s.dialect == sqlschema.MySQL }
