package main

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// Where the time goes (-stmts, BENCH_STMTS=1): the connections of the
// router and relay sections count every statement they send, by its shape,
// and the time from sending it to its answer (client side: the round trip
// and the server's work). After the table, each run's statements per item
// (message or event) are printed: how many round trips a message costs on
// each engine, and which statement takes the time. PostgreSQL through a
// pgx tracer (a pgx batch is one round trip, its statements counted
// within it), MariaDB through a database/sql driver wrapper (a prepared
// statement's PREPARE is a round trip of its own). Tracing costs a few µs
// per statement: take the rates of a -stmts run with that in mind.

// stmtTrace accumulates the statements of one connection pool.
type stmtTrace struct {
	mu    sync.Mutex
	by    map[string]*stmtStat
	shape map[string]string // cache: statement text -> shape
}

type stmtStat struct {
	n int64
	d time.Duration
}

func newStmtTrace() *stmtTrace {
	return &stmtTrace{by: map[string]*stmtStat{}, shape: map[string]string{}}
}

func (t *stmtTrace) add(sql string, d time.Duration) {
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	s, ok := t.shape[sql]
	if !ok {
		s = stmtShape(sql)
		if len(t.shape) < 10_000 {
			t.shape[sql] = s
		}
	}
	st := t.by[s]
	if st == nil {
		st = &stmtStat{}
		t.by[s] = st
	}
	st.n++
	st.d += d
}

// take returns what was counted since the last take, and starts afresh.
func (t *stmtTrace) take() map[string]stmtStat {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make(map[string]stmtStat, len(t.by))
	for k, v := range t.by {
		out[k] = *v
	}
	t.by = map[string]*stmtStat{}
	return out
}

var (
	shapeComment = regexp.MustCompile(`(?m)--[^\n]*$|/\*[\s\S]*?\*/`)
	shapeSpace   = regexp.MustCompile(`\s+`)
	shapeString  = regexp.MustCompile(`'(?:[^'\\]|''|\\.)*'`)
	shapeNumber  = regexp.MustCompile(`([^$\w])\d+\b`)
	shapeSchema  = regexp.MustCompile("[\"`]?benchtable_\\w+[\"`]?\\.")
	shapeInList  = regexp.MustCompile(`\((?:\s*(?:\?|\$\d+|N)\s*,)+\s*(?:\?|\$\d+|N)\s*\)`)
	shapeMaxSize = 90
)

// stmtShape is a statement without its comments, literals, schema and
// whitespace, shortened: what identifies it in the -stmts table.
func stmtShape(sql string) string {
	s := shapeComment.ReplaceAllString(sql, "")
	s = shapeSpace.ReplaceAllString(strings.TrimSpace(s), " ")
	s = shapeString.ReplaceAllString(s, "?")
	s = shapeNumber.ReplaceAllString(s, "${1}N")
	s = shapeSchema.ReplaceAllString(s, "")
	s = shapeInList.ReplaceAllString(s, "(…)")
	if r := []rune(s); len(r) > shapeMaxSize {
		s = string(r[:shapeMaxSize]) + "…"
	}
	return strings.ReplaceAll(s, "|", `\|`)
}

// stmtAccount is one run's statements over its timed sections.
type stmtAccount struct {
	id    string
	items int64
	wall  time.Duration
	by    map[string]stmtStat
}

func (h *harness) addStmts(id string, items int, wall time.Duration, got map[string]stmtStat) {
	a := h.stmtsByID[id]
	if a == nil {
		a = &stmtAccount{id: id, by: map[string]stmtStat{}}
		h.stmtsByID[id] = a
		h.stmts = append(h.stmts, a)
	}
	a.items += int64(items)
	a.wall += wall
	for k, v := range got {
		s := a.by[k]
		s.n += v.n
		s.d += v.d
		a.by[k] = s
	}
}

// timedTraced is timed with the statements trace counted during f (a nil
// trace: timed).
func (h *harness) timedTraced(id string, trace *stmtTrace, f func() (int, time.Duration, error)) error {
	if trace == nil {
		return h.timed(id, f)
	}
	trace.take()
	var n int
	var wall time.Duration
	err := h.timed(id, func() (int, time.Duration, error) {
		var err error
		n, wall, err = f()
		return n, wall, err
	})
	got := trace.take()
	if err == nil {
		h.addStmts(id, n, wall, got)
	}
	return err
}

// printStmts writes each traced run's statements per item.
func (h *harness) printStmts(w io.Writer) {
	fmt.Fprintln(w, "Statements per item (-stmts): client side, from sending a statement to its answer, summed over the statements in flight; "+
		"\"per item\" divides by the messages or events timed. A pgx batch is one round trip; the statements within it count no time of their own.")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "| run | statement | per item | µs per item | µs each |")
	fmt.Fprintln(w, "|---|---|---|---|---|")
	for _, a := range h.stmts {
		if a.items == 0 || len(a.by) == 0 {
			continue
		}
		keys := make([]string, 0, len(a.by))
		var n int64
		var d time.Duration
		for k, v := range a.by {
			keys = append(keys, k)
			n += v.n
			d += v.d
		}
		slices.SortFunc(keys, func(x, y string) int {
			if c := a.by[y].d - a.by[x].d; c != 0 {
				if c > 0 {
					return 1
				}
				return -1
			}
			return strings.Compare(x, y)
		})
		per := func(v float64) string {
			v /= float64(a.items)
			if v < 0.1 {
				return strconv.FormatFloat(v, 'f', 4, 64)
			}
			return strconv.FormatFloat(v, 'f', 2, 64)
		}
		us := func(d time.Duration) string {
			return strconv.FormatFloat(float64(d.Microseconds())/float64(a.items), 'f', 0, 64)
		}
		fmt.Fprintf(w, "| %s | **all** (wall %s µs per item) | %s | %s | — |\n", a.id,
			strconv.FormatFloat(float64(a.wall.Microseconds())/float64(a.items), 'f', 0, 64), per(float64(n)), us(d))
		for _, k := range keys {
			v := a.by[k]
			each := "—"
			if v.n > 0 && v.d > 0 {
				each = strconv.FormatFloat(float64(v.d.Microseconds())/float64(v.n), 'f', 0, 64)
			}
			fmt.Fprintf(w, "| | `%s` | %s | %s | %s |\n", k, per(float64(v.n)), us(v.d), each)
		}
	}
}

// pgxTracer traces a pgx pool's statements (pgx.QueryTracer,
// pgx.BatchTracer).
type pgxTracer struct{ t *stmtTrace }

type traceStartKey struct{}

type traceStart struct {
	sql string
	at  time.Time
}

func (p pgxTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return context.WithValue(ctx, traceStartKey{}, traceStart{sql: d.SQL, at: time.Now()})
}

func (p pgxTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if s, ok := ctx.Value(traceStartKey{}).(traceStart); ok {
		p.t.add(s.sql, time.Since(s.at))
	}
}

func (p pgxTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	return context.WithValue(ctx, traceStartKey{}, traceStart{sql: "(pgx batch: one round trip)", at: time.Now()})
}

func (p pgxTracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	p.t.add("(in a batch) "+d.SQL, 0)
}

func (p pgxTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchEndData) {
	if s, ok := ctx.Value(traceStartKey{}).(traceStart); ok {
		p.t.add(s.sql, time.Since(s.at))
	}
}

// tracedConnector wraps go-sql-driver/mysql's connector: its connections
// count their statements, transactions and prepares. Driver() is the
// wrapped one's, so that the library still sees a MySQL handle.
type tracedConnector struct {
	driver.Connector
	trace *stmtTrace
}

func (c *tracedConnector) Connect(ctx context.Context) (driver.Conn, error) {
	conn, err := c.Connector.Connect(ctx)
	if err != nil {
		return nil, err
	}
	return &tracedConn{Conn: conn, trace: c.trace}, nil
}

// tracedConn forwards every interface of go-sql-driver/mysql's connection
// (database/sql takes another path for one it lacks: a prepare per
// ExecContext without ExecerContext, for instance), timing the statements.
type tracedConn struct {
	driver.Conn
	trace *stmtTrace
}

var (
	_ driver.ConnBeginTx        = (*tracedConn)(nil)
	_ driver.ConnPrepareContext = (*tracedConn)(nil)
	_ driver.ExecerContext      = (*tracedConn)(nil)
	_ driver.QueryerContext     = (*tracedConn)(nil)
	_ driver.Pinger             = (*tracedConn)(nil)
	_ driver.NamedValueChecker  = (*tracedConn)(nil)
	_ driver.SessionResetter    = (*tracedConn)(nil)
	_ driver.Validator          = (*tracedConn)(nil)
	_ driver.StmtExecContext    = (*tracedStmt)(nil)
	_ driver.StmtQueryContext   = (*tracedStmt)(nil)
	_ driver.NamedValueChecker  = (*tracedStmt)(nil)
)

func (c *tracedConn) BeginTx(ctx context.Context, opts driver.TxOptions) (driver.Tx, error) {
	start := time.Now()
	tx, err := c.Conn.(driver.ConnBeginTx).BeginTx(ctx, opts)
	c.trace.add("BEGIN", time.Since(start))
	if err != nil {
		return nil, err
	}
	return &tracedTx{Tx: tx, trace: c.trace}, nil
}

func (c *tracedConn) PrepareContext(ctx context.Context, query string) (driver.Stmt, error) {
	start := time.Now()
	st, err := c.Conn.(driver.ConnPrepareContext).PrepareContext(ctx, query)
	c.trace.add("(PREPARE) "+query, time.Since(start))
	if err != nil {
		return nil, err
	}
	return &tracedStmt{Stmt: st, query: query, trace: c.trace}, nil
}

func (c *tracedConn) ExecContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Result, error) {
	start := time.Now()
	r, err := c.Conn.(driver.ExecerContext).ExecContext(ctx, query, args)
	if !errors.Is(err, driver.ErrSkip) { // ErrSkip: database/sql prepares instead
		c.trace.add(query, time.Since(start))
	}
	return r, err
}

func (c *tracedConn) QueryContext(ctx context.Context, query string, args []driver.NamedValue) (driver.Rows, error) {
	start := time.Now()
	r, err := c.Conn.(driver.QueryerContext).QueryContext(ctx, query, args)
	if !errors.Is(err, driver.ErrSkip) {
		c.trace.add(query, time.Since(start))
	}
	return r, err
}

func (c *tracedConn) Ping(ctx context.Context) error { return c.Conn.(driver.Pinger).Ping(ctx) }

func (c *tracedConn) CheckNamedValue(nv *driver.NamedValue) error {
	return c.Conn.(driver.NamedValueChecker).CheckNamedValue(nv)
}

func (c *tracedConn) ResetSession(ctx context.Context) error {
	return c.Conn.(driver.SessionResetter).ResetSession(ctx)
}

func (c *tracedConn) IsValid() bool { return c.Conn.(driver.Validator).IsValid() }

type tracedTx struct {
	driver.Tx
	trace *stmtTrace
}

func (t *tracedTx) Commit() error {
	start := time.Now()
	err := t.Tx.Commit()
	t.trace.add("COMMIT", time.Since(start))
	return err
}

func (t *tracedTx) Rollback() error {
	start := time.Now()
	err := t.Tx.Rollback()
	t.trace.add("ROLLBACK", time.Since(start))
	return err
}

type tracedStmt struct {
	driver.Stmt
	query string
	trace *stmtTrace
}

func (s *tracedStmt) ExecContext(ctx context.Context, args []driver.NamedValue) (driver.Result, error) {
	start := time.Now()
	r, err := s.Stmt.(driver.StmtExecContext).ExecContext(ctx, args)
	s.trace.add("(EXECUTE) "+s.query, time.Since(start))
	return r, err
}

func (s *tracedStmt) QueryContext(ctx context.Context, args []driver.NamedValue) (driver.Rows, error) {
	start := time.Now()
	r, err := s.Stmt.(driver.StmtQueryContext).QueryContext(ctx, args)
	s.trace.add("(EXECUTE) "+s.query, time.Since(start))
	return r, err
}

func (s *tracedStmt) CheckNamedValue(nv *driver.NamedValue) error {
	if c, ok := s.Stmt.(driver.NamedValueChecker); ok {
		return c.CheckNamedValue(nv)
	}
	return driver.ErrSkip
}
