// Package pgerr classifies the errors the library gets from PostgreSQL, the
// drivers (pgx/v5, database/sql) and poolers in front of them. It decides
// these things, each on the error alone:
//
//   - Unreachable: the database cannot be reached right now (the connection
//     could not be made, was lost, or the server is shutting down or full).
//     Only these may run a handler fail-open.
//   - SerializationFailure: the statement lost a race under REPEATABLE READ
//     or SERIALIZABLE (40001) or a deadlock (40P01); a new transaction may
//     succeed.
//   - Deterministic: the statement will fail the same way if repeated (a
//     constraint, a data error, a missing table, an aborted transaction).
//   - CommitRefused: the server refused a COMMIT, so nothing of the
//     transaction committed (a definite outcome), as opposed to a COMMIT
//     whose outcome is unknown (a lost connection, a timeout).
//   - InFailedTransaction: the statement was refused only because an
//     earlier statement of its transaction had failed (25P02): the cause is
//     elsewhere in the transaction.
//
// Drivers other than pgx are recognised through the SQLState() method that
// pgconn.PgError and lib/pq's Error both have, and through the standard
// net.Error, io.EOF and driver.ErrBadConn.
package pgerr

import (
	"context"
	"database/sql/driver"
	"errors"
	"io"
	"net"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Code returns the SQLSTATE of err (the outermost one that has it), or "".
func Code(err error) string {
	var s interface{ SQLState() string }
	if errors.As(err, &s) {
		return s.SQLState()
	}
	return ""
}

// unreachableCodes are the SQLSTATEs, besides class 08, that say the server
// cannot take work now: shutting down (57P01 admin_shutdown, 57P02
// crash_shutdown), starting up (57P03 cannot_connect_now), full (53300
// too_many_connections).
var unreachableCodes = map[string]bool{"57P01": true, "57P02": true, "57P03": true, "53300": true}

// Unreachable reports whether err means the database cannot be reached: the
// connection could not be made at the network level, was lost, or the server
// refused it because it is shutting down, starting, or full (SQLSTATE class
// 08 except 08P01, 57P01, 57P02, 57P03, 53300).
//
// A connection attempt that timed out (connect_timeout: the server does not
// answer) counts; the caller's own context ending does not (the middleware
// checks the message's context before it fails open).
//
// It is false for everything else: statement errors (serialization failures,
// lock and statement timeouts, missing tables, constraint violations),
// authentication and configuration errors, 08P01 (protocol violation, which
// is how PgBouncer reports its own refusals and limits), a closed pool, and
// the caller's context ending outside a connection attempt.
func Unreachable(err error) bool {
	if err == nil {
		return false
	}
	if code := Code(err); code != "" {
		return (strings.HasPrefix(code, "08") && code != "08P01") || unreachableCodes[code]
	}
	var connectErr *pgconn.ConnectError
	if errors.As(err, &connectErr) {
		// Dial, TLS or startup failure with no server error code, also a
		// connect timeout (a server that does not answer). Whether the
		// caller's own context ended is the caller's to check.
		return true
	}
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	if errors.Is(err, driver.ErrBadConn) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, pgconn.ErrConnClosed) || errors.Is(err, net.ErrClosed) {
		return true
	}
	var netErr net.Error
	return errors.As(err, &netErr)
}

// SerializationFailure reports whether err is a serialization failure
// (40001) or a detected deadlock (40P01): the transaction lost a race and a
// new transaction may succeed.
func SerializationFailure(err error) bool {
	code := Code(err)
	return code == "40001" || code == "40P01"
}

// deterministicClasses are SQLSTATE classes whose errors repeat when the same
// statement runs again on the same data.
var deterministicClasses = map[string]bool{
	"09": true, // triggered action exception
	"0A": true, // feature not supported
	"21": true, // cardinality violation
	"22": true, // data exception
	"23": true, // integrity constraint violation (also a deferred one at COMMIT)
	"25": true, // invalid transaction state (25P02: an earlier statement failed and was ignored)
	"27": true, // triggered data change violation
	"2F": true, // SQL routine exception
	"38": true, // external routine exception
	"39": true, // external routine invocation exception
	"42": true, // syntax error or access rule violation (missing table, permission)
	"44": true, // WITH CHECK OPTION violation
	"P0": true, // PL/pgSQL raise exception
}

// Deterministic reports whether err is a server error that repeats when the
// same work is done again: SQLSTATE classes 09, 0A, 21, 22, 23, 25, 27, 2F,
// 38, 39, 42, 44 and P0. Connection, resource, timeout and serialization
// errors are not deterministic.
func Deterministic(err error) bool {
	code := Code(err)
	return len(code) == 5 && deterministicClasses[code[:2]]
}

// refusedAtCommit are the SQLSTATEs, besides the Deterministic classes,
// with which PostgreSQL refuses a COMMIT and rolls the transaction back: a
// serialization failure found at commit (40001), a deadlock in a deferred
// trigger (40P01), a transaction integrity violation (40002). Not 40003
// (statement completion unknown).
var refusedAtCommit = map[string]bool{"40001": true, "40P01": true, "40002": true}

// CommitRefused reports whether err, returned by a transaction's COMMIT,
// means that the server refused to commit: the transaction was rolled back
// and nothing of it is visible to anyone. This is a definite outcome:
// redoing the transaction's work is safe. It is true for
//
//   - pgx.ErrTxCommitRollback: the server answered COMMIT with ROLLBACK,
//     because a statement of the transaction had failed earlier and its
//     error was ignored (a handler that treats a unique violation as "already
//     there"). pgx returns it for database/sql through its stdlib driver
//     too. It carries no SQLSTATE, so Deterministic is false for it;
//   - an error with a Deterministic SQLSTATE (a deferred constraint or
//     trigger refused the commit; 25P02 for a statement in a transaction an
//     earlier one aborted), or 40001, 40P01, 40002.
//
// It is false for everything else, whose outcome is unknown: a connection
// lost or refused during the commit, a timeout, a server shutting down (a
// session terminated during the commit may have committed locally), a
// pooler's own errors (08P01), an internal error.
func CommitRefused(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, pgx.ErrTxCommitRollback) {
		return true
	}
	return Deterministic(err) || refusedAtCommit[Code(err)]
}

// InFailedTransaction reports whether err is PostgreSQL's refusal of a
// statement in a transaction that an earlier statement aborted (25P02,
// in_failed_sql_transaction: "current transaction is aborted, commands
// ignored until end of transaction block"). The statement itself is not the
// cause: in a transaction shared by several units of work, the one that
// got this error may be innocent.
func InFailedTransaction(err error) bool { return Code(err) == "25P02" }
