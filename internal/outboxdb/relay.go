package outboxdb

import (
	"context"
	"errors"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Probe reports whether the table has a row with an ordering key, and
// turns JIT compilation off for the rest of tx (relay.sql's Probe; on
// MySQL there is no JIT).
func (s *Store) Probe(ctx context.Context, tx wsql.ContextExecutor) (keyed bool, err error) {
	var jit string
	err = seam.QueryRow(ctx, tx, s.st.Get("Probe"), nil, &jit, &keyed)
	return keyed, err
}

// Claim is what one relay batch asks for.
type Claim struct {
	// Size is the most rows of the batch.
	Size int
	// Retry is the most rows that failed before the batch takes when
	// enough others wait.
	Retry int
	// Paused are the topics whose rows wait.
	Paused []string
	// Keyed selects the statement of a table with rows with an ordering
	// key (Probe): ClaimKeyed, else ClaimPlain.
	Keyed bool
	// Window is how many of the oldest rows the heads of keys are looked
	// for among (Keyed only).
	Window int
}

// Claimed is a row a batch locked, in id order.
type Claimed struct {
	ID          int64
	Topic       string
	UUID        string
	Payload     []byte
	Metadata    string // JSON, as stored
	Retry       bool   // the row failed before
	OrderingKey string // "" for none
	// Blocked: an earlier row of its key is neither in the batch nor
	// left behind it (another relay has it): the row is left as it was.
	Blocked bool
}

// ClaimBatch locks a relay batch in tx, FOR UPDATE SKIP LOCKED, and
// returns its rows in id order (relay.sql's ClaimKeyed and ClaimPlain).
//
// On MySQL the batch is several statements (relay_mysql.go), with the same
// semantics; tx must be READ COMMITTED there too.
func (s *Store) ClaimBatch(ctx context.Context, tx wsql.ContextExecutor, c Claim) ([]Claimed, error) {
	if s.dialect == sqlschema.MySQL {
		return s.claimMySQL(ctx, tx, c)
	}
	paused := c.Paused
	if paused == nil {
		paused = []string{}
	}
	var (
		rows wsql.Rows
		err  error
	)
	if c.Keyed {
		rows, err = tx.QueryContext(ctx, s.st.Get("ClaimKeyed"), c.Size, c.Retry, paused, c.Window)
	} else {
		rows, err = tx.QueryContext(ctx, s.st.Get("ClaimPlain"), c.Size, c.Retry, paused)
	}
	if err != nil {
		return nil, err
	}
	out := make([]Claimed, 0, c.Size)
	for rows.Next() {
		var r Claimed
		var key *string
		if err := rows.Scan(&r.ID, &r.Topic, &r.UUID, &r.Payload, &r.Metadata, &r.Retry, &key, &r.Blocked); err != nil {
			_ = rows.Close()
			return nil, err
		}
		if key != nil {
			r.OrderingKey = *key
		}
		out = append(out, r)
	}
	return out, seam.Close(rows)
}

// DeleteRelayed deletes the rows the publisher accepted.
func (s *Store) DeleteRelayed(ctx context.Context, tx wsql.ContextExecutor, ids []int64) error {
	if s.dialect == sqlschema.MySQL {
		return s.deleteMySQL(ctx, tx, ids)
	}
	_, err := tx.ExecContext(ctx, s.st.Get("DeleteRelayed"), ids)
	return err
}

// Failure is one failed row of a batch.
type Failure struct {
	ID        int64
	Permanent bool   // the message's own failure: counts towards MaxAttempts
	Defect    bool   // unreadable: quarantined at once
	Error     string // the error's text, truncated by the caller
}

// Backoff is how failed rows wait and when they are quarantined.
type Backoff struct {
	// Base and Max are the backoff's first and longest waits, in
	// microseconds: min(Base * 2^failures, Max).
	Base, Max float64
	// MaxAttempts is the number of permanent failures that quarantine a
	// row.
	MaxAttempts int
}

// Recorded is a row whose failure RecordFailures recorded.
type Recorded struct {
	ID                 int64
	Topic, UUID        string
	Attempts, Failures int
	Quarantined        bool
	LastError          string
}

// RecordFailures records the failures of a batch in one statement
// (relay.sql's RecordFailures; on MySQL one per row) and returns the rows
// as they are now.
func (s *Store) RecordFailures(ctx context.Context, tx wsql.ContextExecutor, failed []Failure, b Backoff) ([]Recorded, error) {
	if s.dialect == sqlschema.MySQL {
		return s.recordMySQL(ctx, tx, failed, b)
	}
	ids := make([]int64, len(failed))
	permanent := make([]bool, len(failed))
	defect := make([]bool, len(failed))
	texts := make([]string, len(failed))
	for i, f := range failed {
		ids[i], permanent[i], defect[i], texts[i] = f.ID, f.Permanent, f.Defect, f.Error
	}
	rows, err := tx.QueryContext(ctx, s.st.Get("RecordFailures"), ids, permanent, defect, texts, b.Base, b.Max, b.MaxAttempts)
	if err != nil {
		return nil, err
	}
	out := make([]Recorded, 0, len(failed))
	for rows.Next() {
		var r Recorded
		if err := rows.Scan(&r.ID, &r.Topic, &r.UUID, &r.Attempts, &r.Failures, &r.Quarantined, &r.LastError); err != nil {
			_ = rows.Close()
			return nil, err
		}
		out = append(out, r)
	}
	return out, seam.Close(rows)
}

// ErrNoTable is returned by IDSequence when the outbox table does not
// exist.
var ErrNoTable = errors.New("the outbox table does not exist")

// IDSequence returns the sequence behind the table's id column and its
// cache (nil when the column draws from none), or ErrNoTable.
func (s *Store) IDSequence(ctx context.Context, q wsql.ContextExecutor) (cache *int64, seq *string, err error) {
	err = seam.QueryRow(ctx, q, s.st.Get("IDSequence"), []any{s.table}, &cache, &seq)
	if errors.Is(err, seam.ErrNoRows) {
		return nil, nil, ErrNoTable
	}
	return cache, seq, err
}

// Conn is the part of a *pgx.Conn the LISTEN session's statements use.
type Conn interface {
	Exec(ctx context.Context, sql string, arguments ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// BackendPID returns the server's process id of conn's session.
func (s *Store) BackendPID(ctx context.Context, conn Conn) (uint32, error) {
	var pid uint32
	err := conn.QueryRow(ctx, s.st.Get("BackendPID")).Scan(&pid)
	return pid, err
}

// Listen LISTENs on the table's NOTIFY channel in conn's session.
func (s *Store) Listen(ctx context.Context, conn Conn) error {
	_, err := conn.Exec(ctx, s.st.Get("Listen"))
	return err
}

// LockListener takes, in conn's session, the shared advisory lock that
// marks a relay's LISTEN session (listen.sql's LockListener). It reports
// false when the table does not exist (nothing is locked then).
func (s *Store) LockListener(ctx context.Context, conn Conn) (bool, error) {
	var held *bool
	if err := conn.QueryRow(ctx, s.st.Get("LockListener"), s.table).Scan(&held); err != nil {
		return false, err
	}
	return held != nil && *held, nil
}
