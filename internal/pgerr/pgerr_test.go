package pgerr_test

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// sqlState is an error with a SQLSTATE, as lib/pq's Error has.
type sqlState string

func (s sqlState) Error() string    { return "pq: " + string(s) }
func (s sqlState) SQLState() string { return string(s) }

func pg(code string) error {
	return fmt.Errorf("wrapped: %w", &pgconn.PgError{Code: code, Message: "m"})
}

func TestClassification(t *testing.T) {
	t.Parallel()
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	for _, c := range []struct {
		name                                      string
		err                                       error
		unreachable, serialization, deterministic bool
	}{
		{name: "nil"},
		{name: "connection refused", err: refused, unreachable: true},
		{name: "EOF", err: fmt.Errorf("read: %w", io.EOF), unreachable: true},
		{name: "unexpected EOF", err: io.ErrUnexpectedEOF, unreachable: true},
		{name: "bad conn", err: driver.ErrBadConn, unreachable: true},
		{name: "conn closed", err: pgconn.ErrConnClosed, unreachable: true},
		{name: "08006 connection failure", err: pg("08006"), unreachable: true},
		{name: "08001 cannot connect", err: pg("08001"), unreachable: true},
		{name: "57P01 admin shutdown", err: pg("57P01"), unreachable: true},
		{name: "57P03 starting up", err: pg("57P03"), unreachable: true},
		{name: "53300 too many connections", err: pg("53300"), unreachable: true},
		{name: "lib/pq style 08006", err: sqlState("08006"), unreachable: true},
		{name: "08P01 protocol violation (PgBouncer's own refusals)", err: pg("08P01")},
		{name: "40001 serialization failure", err: pg("40001"), serialization: true},
		{name: "40P01 deadlock", err: pg("40P01"), serialization: true},
		{name: "55P03 lock timeout", err: pg("55P03")},
		{name: "57014 statement timeout", err: pg("57014")},
		{name: "28P01 bad password", err: pg("28P01")},
		{name: "3D000 no such database", err: pg("3D000")},
		{name: "42P01 missing table", err: pg("42P01"), deterministic: true},
		{name: "42P05 prepared statement exists", err: pg("42P05"), deterministic: true},
		{name: "23505 unique violation", err: pg("23505"), deterministic: true},
		{name: "23503 foreign key (deferred, at COMMIT)", err: pg("23503"), deterministic: true},
		{name: "22021 bad encoding", err: pg("22021"), deterministic: true},
		{name: "25P02 aborted transaction", err: pg("25P02"), deterministic: true},
		{name: "P0001 raise exception", err: pg("P0001"), deterministic: true},
		{name: "context canceled", err: fmt.Errorf("x: %w", context.Canceled)},
		{name: "deadline exceeded", err: context.DeadlineExceeded},
		{name: "plain error", err: errors.New("something")},
	} {
		require.Equal(t, c.unreachable, pgerr.Unreachable(c.err), "%s: Unreachable", c.name)
		require.Equal(t, c.serialization, pgerr.SerializationFailure(c.err), "%s: SerializationFailure", c.name)
		require.Equal(t, c.deterministic, pgerr.Deterministic(c.err), "%s: Deterministic", c.name)
	}
}

// The classification of errors the real server and driver produce.
func TestClassificationOfRealErrors(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	// A port nothing listens on: the connection cannot be made.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	_, err = pgx.Connect(ctx, "postgres://postgres@"+addr+"/test?connect_timeout=5")
	require.Error(t, err)
	require.True(t, pgerr.Unreachable(err), "dial refused: %v", err)

	pool := testenv.Pool(t)
	_, err = pool.Exec(ctx, "SELECT * FROM no_such_table_anywhere")
	require.False(t, pgerr.Unreachable(err))
	require.True(t, pgerr.Deterministic(err), "%v", err)

	// A session terminated by an administrator: the connection is lost.
	conn, err := pgx.Connect(ctx, testenv.DatabaseURL())
	require.NoError(t, err)
	defer conn.Close(ctx)
	var pid int
	require.NoError(t, conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))
	_, err = pool.Exec(ctx, "SELECT pg_terminate_backend($1)", pid)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "SELECT 1")
	require.Error(t, err)
	require.True(t, pgerr.Unreachable(err), "terminated session: %v", err)
	require.False(t, pgerr.Deterministic(err))
}

// A server that accepts the connection and never answers (a black hole):
// the connect timeout is the database being unreachable, not the caller's
// context ending.
func TestConnectTimeoutIsUnreachable(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = ln.Close() }()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			defer func() { _ = c.Close() }()
		}
	}()
	_, err = pgx.Connect(context.Background(), "postgres://postgres@"+ln.Addr().String()+"/test?connect_timeout=1")
	require.Error(t, err)
	require.True(t, pgerr.Unreachable(err), "connect timeout: %v", err)
}

// pgFatal is a server error of severity FATAL, as pgx reports it.
func pgFatal(code string) error {
	return fmt.Errorf("wrapped: %w", &pgconn.PgError{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: code, Message: "m"})
}

// CommitRefused tells a COMMIT the server refused (nothing committed) from
// one whose outcome is unknown; InFailedTransaction tells a statement that
// failed only because an earlier one had aborted the transaction.
func TestCommitClassification(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name          string
		err           error
		refused       bool
		inFailedTx    bool
		deterministic bool
	}{
		{name: "nil"},
		// COMMIT of an aborted transaction: PostgreSQL answers ROLLBACK.
		// pgx returns ErrTxCommitRollback, also through database/sql's
		// stdlib driver (which returns it as is); it has no SQLSTATE.
		{name: "pgx ErrTxCommitRollback", err: pgx.ErrTxCommitRollback, refused: true},
		{name: "ErrTxCommitRollback wrapped", err: fmt.Errorf("commit: %w", pgx.ErrTxCommitRollback), refused: true},
		// A statement after the abort, pgx or lib/pq style.
		{name: "25P02 aborted transaction", err: pg("25P02"), refused: true, inFailedTx: true, deterministic: true},
		{name: "lib/pq style 25P02", err: sqlState("25P02"), refused: true, inFailedTx: true, deterministic: true},
		// Refusals at COMMIT itself.
		{name: "23505 deferred unique constraint", err: pg("23505"), refused: true, deterministic: true},
		{name: "23503 deferred foreign key", err: pg("23503"), refused: true, deterministic: true},
		{name: "lib/pq style 23505", err: sqlState("23505"), refused: true, deterministic: true},
		{name: "P0001 deferred trigger raises", err: pg("P0001"), refused: true, deterministic: true},
		{name: "40001 serialization failure at commit", err: pg("40001"), refused: true},
		{name: "40P01 deadlock in a deferred trigger", err: pg("40P01"), refused: true},
		// Unknown outcomes: the commit may have happened.
		{name: "40003 statement completion unknown", err: pg("40003")},
		{name: "57P01 FATAL admin shutdown during commit", err: pgFatal("57P01")},
		{name: "08006 connection failure", err: pg("08006")},
		{name: "08P01 PgBouncer: server connection lost", err: pg("08P01")},
		{name: "XX000 internal error", err: pg("XX000")},
		{name: "57014 query canceled", err: pg("57014")},
		{name: "EOF", err: io.ErrUnexpectedEOF},
		{name: "bad conn", err: driver.ErrBadConn},
		{name: "conn closed", err: pgconn.ErrConnClosed},
		{name: "deadline exceeded", err: context.DeadlineExceeded},
		{name: "plain error", err: errors.New("commit failed")},
	} {
		require.Equal(t, c.refused, pgerr.CommitRefused(c.err), "%s: CommitRefused", c.name)
		require.Equal(t, c.inFailedTx, pgerr.InFailedTransaction(c.err), "%s: InFailedTransaction", c.name)
		require.Equal(t, c.deterministic, pgerr.Deterministic(c.err), "%s: Deterministic", c.name)
	}
}

// The errors a real COMMIT returns, through pgx and through database/sql
// over pgx's stdlib driver.
func TestCommitClassificationOfRealErrors(t *testing.T) {
	t.Parallel()
	for _, name := range testenv.DriverNames {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			db := testenv.DriverNamed(t, name).DB
			table := testenv.Unique(t, "commit_refused")
			_, err := db.ExecContext(ctx, "CREATE TABLE "+table+" (id int, CONSTRAINT "+table+"_u UNIQUE (id) DEFERRABLE INITIALLY DEFERRED)")
			require.NoError(t, err)
			t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP TABLE "+table) })
			_, err = db.ExecContext(ctx, "INSERT INTO "+table+" VALUES (1)")
			require.NoError(t, err)

			// A statement fails and its error is ignored: the next
			// statement is refused (25P02), and so is the COMMIT.
			tx, err := db.BeginTx(ctx, nil)
			require.NoError(t, err)
			_, err = tx.ExecContext(ctx, "SELECT 1/0")
			require.Equal(t, "22012", pgerr.Code(err))
			_, err = tx.ExecContext(ctx, "INSERT INTO "+table+" VALUES (2)")
			require.True(t, pgerr.InFailedTransaction(err), "%v", err)
			require.True(t, pgerr.CommitRefused(err), "%v", err)
			err = tx.Commit()
			require.Error(t, err)
			require.ErrorIs(t, err, pgx.ErrTxCommitRollback)
			require.Empty(t, pgerr.Code(err), "no SQLSTATE: %v", err)
			require.False(t, pgerr.Deterministic(err))
			require.True(t, pgerr.CommitRefused(err), "%v", err)

			// A deferred constraint refuses the COMMIT.
			tx, err = db.BeginTx(ctx, nil)
			require.NoError(t, err)
			_, err = tx.ExecContext(ctx, "INSERT INTO "+table+" VALUES (1)")
			require.NoError(t, err)
			err = tx.Commit()
			require.Equal(t, "23505", pgerr.Code(err), "%v", err)
			require.True(t, pgerr.CommitRefused(err), "%v", err)

			// The session is terminated before the COMMIT: the client
			// cannot tell what happened.
			tx, err = db.BeginTx(ctx, nil)
			require.NoError(t, err)
			var pid int
			require.NoError(t, seam.QueryRow(ctx, tx, "SELECT pg_backend_pid()", nil, &pid))
			_, err = testenv.Pool(t).Exec(ctx, "SELECT pg_terminate_backend($1)", pid)
			require.NoError(t, err)
			err = tx.Commit()
			require.Error(t, err)
			require.False(t, pgerr.CommitRefused(err), "%v", err)
			require.True(t, pgerr.Unreachable(err), "%v", err)
			require.Equal(t, int64(1), countRows(ctx, t, db, table), "nothing of the three transactions committed")
		})
	}
}

func countRows(ctx context.Context, t *testing.T, db wsql.Beginner, table string) int64 {
	t.Helper()
	var n int64
	require.NoError(t, seam.QueryRow(ctx, db, "SELECT count(*) FROM "+table, nil, &n))
	return n
}

// TestReadOnly: a hot standby's refusals, PostgreSQL's 25006 and its
// refusal of BEGIN ... READ WRITE (0A000 with that message), are ReadOnly
// and wrapped with ErrDBReadOnly by IfReadOnly; another 0A000 is not.
func TestReadOnly(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&pgconn.PgError{Code: "25006", Message: "cannot execute INSERT in a read-only transaction"}, true},
		{fmt.Errorf("begin: %w", &pgconn.PgError{Code: "0A000", Message: "cannot set transaction read-write mode during recovery"}), true},
		{&pgconn.PgError{Code: "0A000", Message: "cannot use RETURN NEXT in a non-SETOF function"}, false},
		{&pgconn.PgError{Code: "25P02"}, false},
		{errors.New("plain"), false},
		{nil, false},
	} {
		if got := pgerr.ReadOnly(c.err); got != c.want {
			t.Errorf("ReadOnly(%v) = %v, want %v", c.err, got, c.want)
		}
		wrapped := pgerr.IfReadOnly(c.err)
		if got := errors.Is(wrapped, pgerr.ErrDBReadOnly); got != c.want {
			t.Errorf("IfReadOnly(%v) wraps ErrDBReadOnly: %v, want %v", c.err, got, c.want)
		}
		if c.err != nil && !errors.Is(wrapped, c.err) {
			t.Errorf("IfReadOnly(%v) lost the cause", c.err)
		}
	}
}
