package outboxdb

import (
	"context"
	"slices"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Pending is the backlog as stats.sql's Pending reads it.
type Pending struct {
	Count           int64
	OldestCreatedAt *time.Time
	OldestAge       *float64 // seconds, the database's now() - OldestCreatedAt
	Failing         int64
	Quarantined     int64
	BlockedKeys     int64
	Blocked         int64
}

// Pending reads the backlog in one statement.
func (s *Store) Pending(ctx context.Context, q wsql.ContextExecutor) (Pending, error) {
	var p Pending
	err := seam.QueryRow(ctx, q, s.st.Get("Pending"), nil,
		&p.Count, &p.OldestCreatedAt, &p.OldestAge, &p.Failing, &p.Quarantined, &p.BlockedKeys, &p.Blocked)
	return p, err
}

// RequeueFailed clears the failure record of every row that has one and
// returns the number of rows cleared.
func (s *Store) RequeueFailed(ctx context.Context, q wsql.ContextExecutor) (int64, error) {
	return seam.Exec(ctx, q, s.st.Get("RequeueFailed"))
}

// PendingRow is a row of PendingRows.
type PendingRow struct {
	ID                int64
	Topic             string
	UUID              string
	CreatedAt         time.Time
	AgeSeconds        float64
	PayloadBytes      int64
	Failures          int
	PermanentFailures int
	NextAttemptAt     *time.Time
	NextInSeconds     float64 // until NextAttemptAt, the database's clock; 0 when none
	QuarantinedAt     *time.Time
	LastError         string
	OrderingKey       string
	// Blocked: the row never failed and waits behind a failed row of its
	// ordering key.
	Blocked bool
}

// PendingRows returns the oldest limit rows: all of them when state is
// "", else the rows of StateQuarantined or StateFailing.
func (s *Store) PendingRows(ctx context.Context, q wsql.ContextExecutor, state string, limit int) ([]PendingRow, error) {
	args := []any{state, limit}
	if s.dialect == sqlschema.MySQL {
		args = []any{state, state, state, limit} // `?` is named once
	}
	rows, err := q.QueryContext(ctx, s.st.Get("PendingRows"), args...)
	if err != nil {
		return nil, err
	}
	var out []PendingRow
	for rows.Next() {
		var r PendingRow
		if err := rows.Scan(&r.ID, &r.Topic, &r.UUID, &r.CreatedAt, &r.AgeSeconds, &r.PayloadBytes,
			&r.Failures, &r.PermanentFailures, &r.NextAttemptAt, &r.NextInSeconds, &r.QuarantinedAt, &r.LastError, &r.OrderingKey, &r.Blocked); err != nil {
			_ = rows.Close()
			return nil, err
		}
		out = append(out, r)
	}
	return out, seam.Close(rows)
}

// Session is a session that looks like a relay's (listen.sql's Relays).
type Session struct {
	PID             int32
	ApplicationName string
	ClientAddr      string
	BackendStart    *time.Time
	State           string
	StateChange     *time.Time
	Listening       bool // it holds a relay's LISTEN lock
	Locking         bool // it holds row locks on the outbox table
}

// Relays lists the sessions that hold a relay's LISTEN lock or row locks
// on the outbox table, at most 1000. Where the dialect has no Relays
// statement (MySQL: no LISTEN, no advisory lock to find a relay by), it
// returns sqlschema.ErrUnsupported.
func (s *Store) Relays(ctx context.Context, q wsql.ContextExecutor) ([]Session, error) {
	if !slices.Contains(s.st.Names(), "Relays") {
		return nil, sqlschema.ErrUnsupported
	}
	rows, err := q.QueryContext(ctx, s.st.Get("Relays"), s.table)
	if err != nil {
		return nil, err
	}
	var out []Session
	for rows.Next() {
		var r Session
		if err := rows.Scan(&r.PID, &r.ApplicationName, &r.ClientAddr, &r.BackendStart, &r.State, &r.StateChange, &r.Listening, &r.Locking); err != nil {
			_ = rows.Close()
			return nil, err
		}
		out = append(out, r)
	}
	return out, seam.Close(rows)
}

// LibraryTable is a table of the library's found in the catalog.
type LibraryTable struct {
	Schema, Name string
	Inbox        bool // an inbox table; else an outbox table
}

// LibraryTables returns the library's tables of every schema the user
// may use, by schema and name (catalog.sql's LibraryTables).
func (s *Store) LibraryTables(ctx context.Context, q wsql.ContextExecutor) ([]LibraryTable, error) {
	rows, err := q.QueryContext(ctx, s.st.Get("LibraryTables"))
	if err != nil {
		return nil, err
	}
	var out []LibraryTable
	for rows.Next() {
		var t LibraryTable
		if err := rows.Scan(&t.Schema, &t.Name, &t.Inbox); err != nil {
			_ = rows.Close()
			return nil, err
		}
		out = append(out, t)
	}
	return out, seam.Close(rows)
}
