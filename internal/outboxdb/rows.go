package outboxdb

import (
	"context"
	"encoding/json"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
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

// args are the filter's parameters, $1 to $10 of the statements of
// rows/*.sql (include/row_filter.sql): NULL for a field not set.
func (f Filter) args() []any {
	var ids any
	if len(f.IDs) > 0 {
		ids = f.IDs
	}
	var metadata any
	if len(f.Metadata) > 0 {
		js, _ := json.Marshal(f.Metadata) // a map of strings always encodes
		metadata = string(js)
	}
	return []any{ids, text(f.Topic), text(f.UUID), text(f.Reason), text(f.OrderingKey),
		stamp(f.QuarantinedSince), stamp(f.QuarantinedBefore), metadata, positive(f.MaxID), stamp(f.AsOf)}
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
	return s.query("FindRows", f), append(f.args(), after, limit)
}

// CountRowsQuery is CountRows' statement for f and its arguments (the plan
// tests EXPLAIN it).
func (s *Store) CountRowsQuery(f Filter, limit int) (string, []any) {
	var bound any
	if limit > 0 {
		bound = limit
	}
	return s.query("CountRows", f), append(f.args(), bound)
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
	rs, err := q.QueryContext(ctx, s.st.Get("GetRow"), id, prefix)
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
// Reason no index serves: it turns sequential scans and JIT off, counts
// (up to limit) the rows f's other conditions select on the indexes, and
// then turns index scans off, so that the read after it goes through the
// indexes' bitmaps. It returns the count.
func (s *Store) BoundedScan(ctx context.Context, tx wsql.ContextExecutor, f Filter, limit int) (int64, error) {
	var a, b string
	if err := seam.QueryRow(ctx, tx, s.st.Get("BoundedScanSettings"), nil, &a, &b); err != nil {
		return 0, err
	}
	f.Reason = ""
	var n int64
	err := seam.QueryRow(ctx, tx, s.query("BoundedScanCount", f), append(f.args(), limit), &n, &a)
	return n, err
}

// LockRow locks row id in tx and returns its failure record, or
// seam.ErrNoRows.
func (s *Store) LockRow(ctx context.Context, tx wsql.ContextExecutor, id int64) (quarantinedAt *time.Time, failures, permanent int, err error) {
	err = seam.QueryRow(ctx, tx, s.st.Get("LockRow"), []any{id}, &quarantinedAt, &failures, &permanent)
	return quarantinedAt, failures, permanent, err
}

// RequeueRow clears the failure record of the quarantined row id, waking
// the relays (at commit), and returns the number of rows changed.
func (s *Store) RequeueRow(ctx context.Context, tx wsql.ContextExecutor, id int64) (int64, error) {
	return s.actOnRow(ctx, tx, "RequeueRow", id)
}

// DiscardRow deletes the quarantined row id and returns the number of
// rows deleted.
func (s *Store) DiscardRow(ctx context.Context, tx wsql.ContextExecutor, id int64) (int64, error) {
	return s.actOnRow(ctx, tx, "DiscardRow", id)
}

func (s *Store) actOnRow(ctx context.Context, tx wsql.ContextExecutor, name string, id int64) (int64, error) {
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
// transaction holds, and wakes the relays when it changed one.
func (s *Store) RequeueMatching(ctx context.Context, q wsql.ContextExecutor, f Filter, after int64, limit int) (Matched, error) {
	return s.actOnMatching(ctx, q, "RequeueMatching", f, after, limit)
}

// DiscardMatching is RequeueMatching deleting the rows.
func (s *Store) DiscardMatching(ctx context.Context, q wsql.ContextExecutor, f Filter, after int64, limit int) (Matched, error) {
	return s.actOnMatching(ctx, q, "DiscardMatching", f, after, limit)
}

func (s *Store) actOnMatching(ctx context.Context, q wsql.ContextExecutor, name string, f Filter, after int64, limit int) (Matched, error) {
	var m Matched
	var ignored bool
	err := seam.QueryRow(ctx, q, s.query(name, f), append(f.args(), after, limit), &m.Acted, &m.Picked, &m.Last, &ignored)
	return m, err
}
