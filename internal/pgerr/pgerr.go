// Package pgerr classifies the errors the library gets from its databases:
// PostgreSQL through pgx/v5, database/sql and poolers in front of them, and
// MySQL or MariaDB through github.com/go-sql-driver/mysql. It decides these
// things, each on the error alone:
//
//   - Unreachable: the database cannot be reached right now (the connection
//     could not be made, was lost, or the server is shutting down or full).
//     Only these may run a handler fail-open.
//   - SerializationFailure: the transaction lost a race (PostgreSQL 40001
//     under REPEATABLE READ or SERIALIZABLE, a deadlock 40P01; MySQL 1213
//     deadlock, 1205 lock wait timeout, 1020, 1412); a new transaction may
//     succeed.
//   - Deterministic: the statement will fail the same way if repeated (a
//     constraint, a data error, a missing table, an aborted transaction, a
//     read-only server or transaction).
//   - UniqueViolation: a unique or primary key refused a row (23505, MySQL
//     1062).
//   - ReadOnly: the write was refused because the server or the
//     transaction is read-only (25006; MySQL 1792, 1290, 1836).
//   - CommitRefused: the server refused a COMMIT, so nothing of the
//     transaction committed (a definite outcome), as opposed to a COMMIT
//     whose outcome is unknown (a lost connection, a timeout).
//   - InFailedTransaction: the statement was refused only because an
//     earlier statement of its transaction had failed (PostgreSQL's 25P02;
//     MySQL has no such state).
//
// PostgreSQL drivers other than pgx are recognised through the SQLState()
// method that pgconn.PgError and lib/pq's Error both have. MySQL errors
// (*mysql.MySQLError) are decided by their error number (MySQLNumber), the
// SQLSTATE helping only for the classes that mean the same in both (22, 23,
// 42, ...): MySQL sends the catch-all HY000 for many errors, and the same
// SQLSTATE for errors of different kinds (40001 is only a deadlock, 08S01
// both a lost connection and a packet too large). Connection errors are
// recognised through the standard net.Error, io.EOF and driver.ErrBadConn,
// pgx's and the MySQL driver's own (mysql.ErrInvalidConn).
//
// The MySQL numbers are those MySQL 8 and MariaDB share (below 1900) and
// each one's own where they do not collide; only MariaDB 10.11 is tested
// against a real server.
package pgerr

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Code returns the SQLSTATE of err (the outermost one that has it), or "".
// For a MySQL error it is the SQLSTATE the server sent with it (23000 for a
// duplicate key, 40001 for a deadlock, often the catch-all HY000), or "" if
// it sent none; MySQLNumber tells MySQL's errors apart.
func Code(err error) string {
	if me, ok := mysqlError(err); ok {
		return mysqlState(me)
	}
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
// For MySQL and MariaDB it is true for the driver's mysql.ErrInvalidConn
// (the connection broke in the middle of a command), driver.ErrBadConn
// (found broken before a command was sent) and network errors (a refused
// or timed out dial), and for the server errors 1040 (too many
// connections), 1203 (max_user_connections), 1053 (server shutdown), 1047
// (a Galera node not ready), 1152, 1184 (aborted connection), 1154,
// 1158-1161 (network read or write errors), 1927 (MariaDB: the connection
// was killed), 3032 (MySQL: offline_mode) and the client library's 2002,
// 2003, 2005, 2006 (server has gone away), 2013 (lost connection during
// query), 2055, which a proxy may send. A driver configured with
// rejectReadOnly=true turns a read-only refusal into driver.ErrBadConn, so
// it counts here instead of in ReadOnly.
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
	if me, ok := mysqlError(err); ok {
		return mysqlUnreachable[me.Number]
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
		errors.Is(err, pgconn.ErrConnClosed) || errors.Is(err, net.ErrClosed) || errors.Is(err, mysql.ErrInvalidConn) {
		return true
	}
	var netErr net.Error
	return errors.As(err, &netErr)
}

// SerializationFailure reports whether err is a serialization failure
// (40001) or a detected deadlock (40P01): the transaction lost a race and a
// new transaction may succeed.
//
// For MySQL and MariaDB it is true for
//
//   - 1213 ER_LOCK_DEADLOCK: InnoDB chose this transaction as a deadlock's
//     victim and rolled all of it back (Galera reports a certification
//     conflict the same way, also at COMMIT);
//   - 1205 ER_LOCK_WAIT_TIMEOUT: innodb_lock_wait_timeout ran out. InnoDB
//     rolled back only the statement, unless innodb_rollback_on_timeout is
//     on (then the whole transaction). MariaDB's NOWAIT and SKIP LOCKED
//     report 1205 too (MySQL's NOWAIT reports 3572, which is no
//     serialization failure, like PostgreSQL's 55P03);
//   - 1020 ER_CHECKREAD: MariaDB's innodb_snapshot_isolation (on by default
//     from 11.8) found, under REPEATABLE READ, that a row the statement
//     locks changed after the transaction's snapshot was taken;
//   - 1412 ER_TABLE_DEF_CHANGED: a table changed after the transaction's
//     consistent snapshot;
//   - 3101 (MySQL group replication: the commit lost a certification
//     conflict).
//
// In every case the caller must roll the transaction back and redo its
// work in a new one: after 1205, 1020 or 1412 the transaction may still be
// open with its earlier statements' effects, and after 1213 the earlier
// statements' effects are gone while the transaction stays open, so that
// further statements would commit without them.
func SerializationFailure(err error) bool {
	if me, ok := mysqlError(err); ok {
		return mysqlSerialization[me.Number]
	}
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
//
// For MySQL and MariaDB it is true for an error whose SQLSTATE has one of
// those classes (22001 data too long, 23000 duplicate key or foreign key or
// CHECK constraint, 42S02 missing table, 42000 syntax error, 25006 write in
// a read-only transaction, ...) and for the numbers that MySQL sends with
// the catch-all HY000 or with no SQLSTATE: among them 1062 (duplicate key),
// 1146 (missing table), 1054 (unknown column), 1064 (syntax), 1406 (data too
// long), 1366 and 1292 (incorrect value), 1364 (no default), 1451 and 1452
// (foreign key), 3819 (MySQL's CHECK constraint; MariaDB's 4025 has 23000,
// MySQL's invalid JSON 3140 has 22032), 1644 (an unhandled SIGNAL), 1153
// (packet larger than max_allowed_packet), and the read-only refusals 1290,
// 1792, 1836, 1874. It is false for the numbers Unreachable or
// SerializationFailure accept and for 1049 (unknown database, as 3D000).
func Deterministic(err error) bool {
	if me, ok := mysqlError(err); ok {
		return mysqlIsDeterministic(me)
	}
	code := Code(err)
	return len(code) == 5 && deterministicClasses[code[:2]]
}

// UniqueViolation reports whether err is a unique or primary key refusing
// a row: PostgreSQL's 23505 (unique_violation); MySQL's 1062 (ER_DUP_ENTRY,
// SQLSTATE 23000, which foreign key and NOT NULL violations share), 1586
// (the same with the key's name), 1022 and 1169. It implies Deterministic.
func UniqueViolation(err error) bool {
	if me, ok := mysqlError(err); ok {
		return mysqlUnique[me.Number]
	}
	return Code(err) == "23505"
}

// ErrDBReadOnly is exactlyonce.ErrDBReadOnly and outbox.ErrDBReadOnly
// (defined here so that both packages wrap the same error): the server took
// the connection but refuses writes.
var ErrDBReadOnly = errors.New("the database refuses writes: a standby or a read-only transaction/server; " +
	"connect to the primary, e.g. target_session_attrs=read-write in a multi-host URL")

// IfReadOnly returns err wrapped with ErrDBReadOnly ("<ErrDBReadOnly>:
// <err>") when ReadOnly(err), and err unchanged otherwise (also when it
// already wraps ErrDBReadOnly).
func IfReadOnly(err error) error {
	if err == nil || errors.Is(err, ErrDBReadOnly) || !ReadOnly(err) {
		return err
	}
	return fmt.Errorf("%w: %w", ErrDBReadOnly, err)
}

// ReadOnly reports whether err refuses a write because the transaction or
// the server is read-only: PostgreSQL's 25006 (read_only_sql_transaction: a
// READ ONLY transaction, default_transaction_read_only, a hot standby) and
// a hot standby's refusal of BEGIN ... READ WRITE (0A000, "cannot set
// transaction read-write mode during recovery");
// MySQL's 1792 (a write in a START TRANSACTION READ ONLY transaction), 1290
// with --read-only or --super-read-only in its message (a read_only server,
// which a replica usually is; 1290 for --secure-file-priv does not count),
// 1836 (ER_READ_ONLY_MODE) and 1874 (InnoDB in read-only mode). It implies
// Deterministic (0A000 is of a Deterministic class too): the same write
// fails again on the same server; another server (after a failover) may
// take it. With the MySQL driver's
// rejectReadOnly=true these become driver.ErrBadConn (see Unreachable).
func ReadOnly(err error) bool {
	if me, ok := mysqlError(err); ok {
		return mysqlIsReadOnly(me)
	}
	switch Code(err) {
	case "25006":
		return true
	case "0A000":
		// A hot standby refuses BEGIN ... READ WRITE (what pgx sends for
		// a database/sql transaction with options) with
		// feature_not_supported: "cannot set transaction read-write mode
		// during recovery".
		var pe *pgconn.PgError
		return errors.As(err, &pe) && strings.Contains(pe.Message, "read-write mode during recovery")
	}
	return false
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
//     earlier one aborted), or 40001, 40P01, 40002;
//   - a MySQL error that Deterministic or SerializationFailure accepts (1213
//     a deadlock or a Galera certification conflict at COMMIT, 3101 group
//     replication's), or 1180 (ER_ERROR_DURING_COMMIT: the storage
//     engine or the binary log refused the commit): MySQL rolls the
//     transaction back when its COMMIT fails. MySQL has no deferred
//     constraints, and a statement's error does not abort its transaction,
//     so COMMIT after an ignored error commits the rest (there is no
//     ErrTxCommitRollback).
//
// It is false for everything else, whose outcome is unknown: a connection
// lost or refused during the commit (for MySQL mysql.ErrInvalidConn, 1927,
// 2013), a timeout, a server shutting down (a session terminated during the
// commit may have committed locally), a pooler's own errors (08P01), an
// internal error, a query interrupted by KILL QUERY (1317).
func CommitRefused(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, pgx.ErrTxCommitRollback) || errors.Is(err, ErrRolledBack) {
		return true
	}
	if me, ok := mysqlError(err); ok {
		return mysqlIsDeterministic(me) || mysqlSerialization[me.Number] || mysqlRefusedAtCommit[me.Number]
	}
	return Deterministic(err) || refusedAtCommit[Code(err)]
}

// ErrRolledBack says that the server had already rolled the transaction
// back when it was to be committed: on MySQL a deadlock (1213), or a lock
// wait timeout under innodb_rollback_on_timeout, ends the transaction but
// not the session, and the statements after it run on their own
// (autocommit), so a COMMIT then succeeds with nothing of the transaction
// in it. A commit that finds this is refused: nothing of the transaction
// committed (CommitRefused).
var ErrRolledBack = errors.New("the server rolled the transaction back before its COMMIT (a deadlock or a lock wait timeout), nothing of it committed")

// InFailedTransaction reports whether err is PostgreSQL's refusal of a
// statement in a transaction that an earlier statement aborted (25P02,
// in_failed_sql_transaction: "current transaction is aborted, commands
// ignored until end of transaction block"). The statement itself is not the
// cause: in a transaction shared by several units of work, the one that
// got this error may be innocent.
//
// MySQL and MariaDB have no such state: a failed statement is rolled back
// alone and its transaction stays open for the next ones (after a deadlock,
// 1213, the transaction's earlier work is gone but later statements still
// run), so it is always false for their errors.
func InFailedTransaction(err error) bool {
	if _, ok := mysqlError(err); ok {
		return false
	}
	return Code(err) == "25P02"
}
