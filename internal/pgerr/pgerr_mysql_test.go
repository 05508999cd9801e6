package pgerr_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/mysqldsn"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
)

// mysqlURL is the MariaDB or MySQL the tests run against.
func mysqlURL() string {
	u := os.Getenv("MYSQL_URL")
	if u == "" {
		return "root@tcp(127.0.0.1:3306)/test?parseTime=true"
	}
	if mysqldsn.IsURL(u) { // make test's form, mysql://user@host:port/db
		if dsn, err := mysqldsn.FromURL(u); err == nil {
			return dsn
		}
	}
	return u
}

// mysqlDB returns a database/sql handle on a fresh database of its own,
// dropped when the test ends. An unreachable server fails the test under
// CI=true and skips it otherwise.
func mysqlDB(t *testing.T) *sql.DB {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg, err := mysql.ParseDSN(mysqlURL())
	require.NoError(t, err)
	cfg.Timeout = 5 * time.Second
	admin, err := sql.Open("mysql", cfg.FormatDSN())
	require.NoError(t, err)
	t.Cleanup(func() { _ = admin.Close() })
	if err := admin.PingContext(ctx); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("mysql unreachable at %s: %v", mysqlURL(), err)
		}
		t.Skipf("mysql unreachable at %s: %v", mysqlURL(), err)
	}
	b := make([]byte, 6)
	_, err = rand.Read(b)
	require.NoError(t, err)
	name := "pgerr_" + hex.EncodeToString(b)
	_, err = admin.ExecContext(ctx, "CREATE DATABASE `"+name+"`")
	require.NoError(t, err)
	t.Cleanup(func() {
		_, err := admin.ExecContext(context.Background(), "DROP DATABASE `"+name+"`")
		require.NoError(t, err)
	})
	cfg.DBName = name
	db, err := sql.Open("mysql", cfg.FormatDSN())
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

func my(number uint16, state string) error {
	me := &mysql.MySQLError{Number: number, Message: "m"}
	copy(me.SQLState[:], state)
	return fmt.Errorf("wrapped: %w", me)
}

func myMsg(number uint16, state, message string) error {
	me := &mysql.MySQLError{Number: number, Message: message}
	copy(me.SQLState[:], state)
	return me
}

func TestMySQLClassification(t *testing.T) {
	t.Parallel()
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: syscall.ECONNREFUSED}
	for _, c := range []struct {
		name                                      string
		err                                       error
		unreachable, serialization, deterministic bool
		unique, readOnly, refused, undefined      bool
		code                                      string
	}{
		// Connections.
		{name: "ErrInvalidConn", err: mysql.ErrInvalidConn, unreachable: true},
		{name: "ErrInvalidConn wrapped", err: fmt.Errorf("exec: %w", mysql.ErrInvalidConn), unreachable: true},
		{name: "bad conn", err: driver.ErrBadConn, unreachable: true},
		{name: "dial refused", err: refused, unreachable: true},
		{name: "unexpected EOF", err: io.ErrUnexpectedEOF, unreachable: true},
		{name: "1040 too many connections", err: my(1040, "08004"), unreachable: true, code: "08004"},
		{name: "1203 max_user_connections", err: my(1203, "42000"), unreachable: true, code: "42000"},
		{name: "1053 server shutdown", err: my(1053, "08S01"), unreachable: true, code: "08S01"},
		{name: "1047 Galera node not ready", err: my(1047, "08S01"), unreachable: true, code: "08S01"},
		{name: "1152 aborted connection", err: my(1152, "08S01"), unreachable: true, code: "08S01"},
		{name: "1158 net read error", err: my(1158, "08S01"), unreachable: true, code: "08S01"},
		{name: "1927 connection killed (MariaDB)", err: my(1927, "70100"), unreachable: true, code: "70100"},
		{name: "3032 offline mode (MySQL)", err: my(3032, "HY000"), unreachable: true, code: "HY000"},
		{name: "2002 cannot connect", err: my(2002, "HY000"), unreachable: true, code: "HY000"},
		{name: "2003 cannot connect to host", err: my(2003, "HY000"), unreachable: true, code: "HY000"},
		{name: "2006 server has gone away", err: my(2006, "HY000"), unreachable: true, code: "HY000"},
		{name: "2013 lost connection", err: my(2013, "HY000"), unreachable: true, code: "HY000"},
		{name: "2013 with no SQLSTATE", err: my(2013, ""), unreachable: true},
		// Races: a new transaction may succeed; refused if at COMMIT.
		{name: "1213 deadlock", err: my(1213, "40001"), serialization: true, refused: true, code: "40001"},
		{name: "1205 lock wait timeout", err: my(1205, "HY000"), serialization: true, refused: true, code: "HY000"},
		{name: "1020 record changed (MariaDB snapshot isolation)", err: my(1020, "HY000"), serialization: true, refused: true, code: "HY000"},
		{name: "1412 table definition changed", err: my(1412, "HY000"), serialization: true, refused: true, code: "HY000"},
		{name: "3101 rollback during commit (MySQL group replication)", err: my(3101, "40000"), serialization: true, refused: true, code: "40000"},
		// Deterministic.
		{name: "1062 duplicate entry", err: my(1062, "23000"), deterministic: true, unique: true, refused: true, code: "23000"},
		{name: "1062 with no SQLSTATE", err: my(1062, ""), deterministic: true, unique: true, refused: true},
		{name: "1586 duplicate entry with key name", err: my(1586, "23000"), deterministic: true, unique: true, refused: true, code: "23000"},
		{name: "1022 duplicate key", err: my(1022, "23000"), deterministic: true, unique: true, refused: true, code: "23000"},
		{name: "1452 foreign key", err: my(1452, "23000"), deterministic: true, refused: true, code: "23000"},
		{name: "1048 null", err: my(1048, "23000"), deterministic: true, refused: true, code: "23000"},
		{name: "1146 missing table", err: my(1146, "42S02"), deterministic: true, refused: true, undefined: true, code: "42S02"},
		{name: "1054 unknown column", err: my(1054, "42S22"), deterministic: true, refused: true, undefined: true, code: "42S22"},
		{name: "1064 syntax", err: my(1064, "42000"), deterministic: true, refused: true, code: "42000"},
		{name: "1406 data too long", err: my(1406, "22001"), deterministic: true, refused: true, code: "22001"},
		{name: "1366 incorrect value (MySQL HY000)", err: my(1366, "HY000"), deterministic: true, refused: true, code: "HY000"},
		{name: "1366 incorrect value (MariaDB 22007)", err: my(1366, "22007"), deterministic: true, refused: true, code: "22007"},
		{name: "3140 invalid JSON (MySQL)", err: my(3140, "22032"), deterministic: true, refused: true, code: "22032"},
		{name: "4025 CHECK constraint (MariaDB)", err: my(4025, "23000"), deterministic: true, refused: true, code: "23000"},
		{name: "3819 CHECK constraint (MySQL)", err: my(3819, "HY000"), deterministic: true, refused: true, code: "HY000"},
		{name: "1644 unhandled SIGNAL", err: my(1644, "45000"), deterministic: true, refused: true, code: "45000"},
		{name: "1153 packet too large", err: my(1153, "08S01"), deterministic: true, refused: true, code: "08S01"},
		// Read-only.
		{name: "1792 read-only transaction", err: my(1792, "25006"), deterministic: true, readOnly: true, refused: true, code: "25006"},
		{name: "1290 --read-only (MariaDB)", err: myMsg(1290, "HY000", "The MariaDB server is running with the --read-only option so it cannot execute this statement"), deterministic: true, readOnly: true, refused: true, code: "HY000"},
		{name: "1290 --super-read-only (MySQL)", err: myMsg(1290, "HY000", "The MySQL server is running with the --super-read-only option so it cannot execute this statement"), deterministic: true, readOnly: true, refused: true, code: "HY000"},
		{name: "1290 --secure-file-priv", err: myMsg(1290, "HY000", "The MySQL server is running with the --secure-file-priv option so it cannot execute this statement"), deterministic: true, refused: true, code: "HY000"},
		{name: "1836 read-only mode", err: my(1836, "HY000"), deterministic: true, readOnly: true, refused: true, code: "HY000"},
		// Neither: outcome unknown at COMMIT, not repeatable, not a race.
		{name: "1180 error during commit", err: my(1180, "HY000"), refused: true, code: "HY000"},
		{name: "1317 query interrupted", err: my(1317, "70100"), code: "70100"},
		{name: "1969 max_statement_time (MariaDB)", err: my(1969, "70100"), code: "70100"},
		{name: "3572 NOWAIT (MySQL)", err: my(3572, "HY000"), code: "HY000"},
		{name: "1045 access denied", err: my(1045, "28000"), code: "28000"},
		{name: "1049 unknown database", err: my(1049, "42000"), code: "42000"},
		{name: "1114 table is full", err: my(1114, "HY000"), code: "HY000"},
		{name: "ErrPktSync", err: mysql.ErrPktSync},
		{name: "context canceled", err: fmt.Errorf("x: %w", context.Canceled)},
	} {
		require.Equal(t, c.unreachable, pgerr.Unreachable(c.err), "%s: Unreachable", c.name)
		require.Equal(t, c.serialization, pgerr.SerializationFailure(c.err), "%s: SerializationFailure", c.name)
		require.Equal(t, c.deterministic, pgerr.Deterministic(c.err), "%s: Deterministic", c.name)
		require.Equal(t, c.unique, pgerr.UniqueViolation(c.err), "%s: UniqueViolation", c.name)
		require.Equal(t, c.readOnly, pgerr.ReadOnly(c.err), "%s: ReadOnly", c.name)
		require.Equal(t, c.refused, pgerr.CommitRefused(c.err), "%s: CommitRefused", c.name)
		require.Equal(t, c.undefined, pgerr.Undefined(c.err), "%s: Undefined", c.name)
		require.False(t, pgerr.InFailedTransaction(c.err), "%s: InFailedTransaction", c.name)
		require.Equal(t, c.code, pgerr.Code(c.err), "%s: Code", c.name)
		var me *mysql.MySQLError
		n, ok := pgerr.MySQLNumber(c.err)
		require.Equal(t, errors.As(c.err, &me), ok, "%s: MySQLNumber", c.name)
		if ok {
			require.Equal(t, me.Number, n, "%s: MySQLNumber", c.name)
		}
	}
}

// The new predicates answer for PostgreSQL too.
func TestUniqueViolationAndReadOnlyPostgres(t *testing.T) {
	t.Parallel()
	require.True(t, pgerr.UniqueViolation(pg("23505")))
	require.True(t, pgerr.UniqueViolation(sqlState("23505")))
	require.False(t, pgerr.UniqueViolation(pg("23503")))
	require.False(t, pgerr.UniqueViolation(nil))
	require.True(t, pgerr.ReadOnly(pg("25006")))
	require.True(t, pgerr.Deterministic(pg("25006")))
	require.False(t, pgerr.ReadOnly(pg("25P02")))
	require.False(t, pgerr.ReadOnly(nil))
	n, ok := pgerr.MySQLNumber(pg("23505"))
	require.False(t, ok)
	require.Zero(t, n)
}

// The classification of errors a real MariaDB and the driver produce.
func TestMySQLClassificationOfRealErrors(t *testing.T) {
	t.Parallel()
	db := mysqlDB(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	for _, stmt := range []string{
		"CREATE TABLE t (id INT PRIMARY KEY, v INT NOT NULL, s VARCHAR(2), CONSTRAINT v_positive CHECK (v >= 0)) ENGINE=InnoDB",
		"CREATE TABLE child (id INT PRIMARY KEY, parent INT NOT NULL, FOREIGN KEY (parent) REFERENCES t (id)) ENGINE=InnoDB",
		"INSERT INTO t (id, v) VALUES (1, 0), (2, 0)",
	} {
		_, err := db.ExecContext(ctx, stmt)
		require.NoError(t, err, stmt)
	}

	t.Run("statement errors", func(t *testing.T) {
		for _, c := range []struct {
			stmt                        string
			number                      uint16
			code                        string
			unique, readOnly, undefined bool
		}{
			{stmt: "SELECT * FROM no_such_table_anywhere", number: 1146, code: "42S02", undefined: true},
			{stmt: "SELECT no_such_column FROM t", number: 1054, code: "42S22", undefined: true},
			{stmt: "INSERT INTO t (id, v) VALUES (1, 0)", number: 1062, code: "23000", unique: true},
			{stmt: "INSERT INTO child (id, parent) VALUES (1, 42)", number: 1452, code: "23000"},
			{stmt: "INSERT INTO t (id, v) VALUES (3, -1)", number: 4025, code: "23000"},
			{stmt: "INSERT INTO t (id, v, s) VALUES (3, 0, 'abc')", number: 1406, code: "22001"},
			{stmt: "INSERT INTO t (id, v) VALUES (3, 'x')", number: 1366},
			{stmt: "SELEKT 1", number: 1064, code: "42000"},
		} {
			_, err := db.ExecContext(ctx, c.stmt)
			require.Error(t, err, c.stmt)
			n, ok := pgerr.MySQLNumber(err)
			require.True(t, ok, "%s: %v", c.stmt, err)
			require.Equal(t, c.number, n, "%s: %v", c.stmt, err)
			if c.code != "" {
				require.Equal(t, c.code, pgerr.Code(err), "%s: %v", c.stmt, err)
			}
			require.True(t, pgerr.Deterministic(err), "%s: %v", c.stmt, err)
			require.True(t, pgerr.CommitRefused(err), "%s: %v", c.stmt, err)
			require.False(t, pgerr.Unreachable(err), "%s: %v", c.stmt, err)
			require.False(t, pgerr.SerializationFailure(err), "%s: %v", c.stmt, err)
			require.Equal(t, c.unique, pgerr.UniqueViolation(err), "%s: %v", c.stmt, err)
			require.Equal(t, c.undefined, pgerr.Undefined(err), "%s: %v", c.stmt, err)
			require.False(t, pgerr.ReadOnly(err), "%s: %v", c.stmt, err)
		}
	})

	t.Run("read-only transaction", func(t *testing.T) {
		tx, err := db.BeginTx(ctx, &sql.TxOptions{ReadOnly: true})
		require.NoError(t, err)
		defer func() { _ = tx.Rollback() }()
		_, err = tx.ExecContext(ctx, "INSERT INTO t (id, v) VALUES (10, 0)")
		require.Error(t, err)
		require.True(t, pgerr.ReadOnly(err), "%v", err)
		require.True(t, pgerr.Deterministic(err), "%v", err)
		require.False(t, pgerr.Unreachable(err), "%v", err)
		require.Equal(t, "25006", pgerr.Code(err), "%v", err)
	})

	t.Run("deadlock", func(t *testing.T) {
		tx1, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer func() { _ = tx1.Rollback() }()
		tx2, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer func() { _ = tx2.Rollback() }()
		_, err = tx1.ExecContext(ctx, "UPDATE t SET v = v + 1 WHERE id = 1")
		require.NoError(t, err)
		_, err = tx2.ExecContext(ctx, "UPDATE t SET v = v + 1 WHERE id = 2")
		require.NoError(t, err)
		errs := make(chan error, 2)
		go func() {
			_, err := tx1.ExecContext(ctx, "UPDATE t SET v = v + 1 WHERE id = 2")
			errs <- err
		}()
		go func() {
			_, err := tx2.ExecContext(ctx, "UPDATE t SET v = v + 1 WHERE id = 1")
			errs <- err
		}()
		var victims []error
		for range 2 {
			if err := <-errs; err != nil {
				victims = append(victims, err)
			}
		}
		require.Len(t, victims, 1, "one transaction is the deadlock's victim: %v", victims)
		err = victims[0]
		n, _ := pgerr.MySQLNumber(err)
		require.Equal(t, uint16(1213), n, "%v", err)
		require.Equal(t, "40001", pgerr.Code(err))
		require.True(t, pgerr.SerializationFailure(err), "%v", err)
		require.True(t, pgerr.CommitRefused(err), "%v", err)
		require.False(t, pgerr.Deterministic(err), "%v", err)
		require.False(t, pgerr.Unreachable(err), "%v", err)
	})

	t.Run("lock wait timeout", func(t *testing.T) {
		tx1, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer func() { _ = tx1.Rollback() }()
		_, err = tx1.ExecContext(ctx, "UPDATE t SET v = v + 1 WHERE id = 1")
		require.NoError(t, err)

		conn, err := db.Conn(ctx)
		require.NoError(t, err)
		defer func() { _ = conn.Close() }()
		_, err = conn.ExecContext(ctx, "SET SESSION innodb_lock_wait_timeout = 1")
		require.NoError(t, err)
		var rollbackOnTimeout bool
		require.NoError(t, conn.QueryRowContext(ctx, "SELECT @@innodb_rollback_on_timeout").Scan(&rollbackOnTimeout))
		tx2, err := conn.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer func() { _ = tx2.Rollback() }()
		_, err = tx2.ExecContext(ctx, "INSERT INTO t (id, v) VALUES (20, 0)")
		require.NoError(t, err)
		_, err = tx2.ExecContext(ctx, "UPDATE t SET v = v + 1 WHERE id = 1")
		require.Error(t, err)
		n, _ := pgerr.MySQLNumber(err)
		require.Equal(t, uint16(1205), n, "%v", err)
		require.True(t, pgerr.SerializationFailure(err), "%v", err)
		require.False(t, pgerr.Deterministic(err), "%v", err)
		require.False(t, pgerr.Unreachable(err), "%v", err)

		// Without innodb_rollback_on_timeout only the statement was
		// rolled back: the transaction's earlier insert is still there,
		// which is why the caller must roll back itself.
		var rows int
		require.NoError(t, tx2.QueryRowContext(ctx, "SELECT count(*) FROM t WHERE id = 20").Scan(&rows))
		if rollbackOnTimeout {
			require.Zero(t, rows)
		} else {
			require.Equal(t, 1, rows)
		}
	})

	t.Run("record changed since the snapshot", func(t *testing.T) {
		conn, err := db.Conn(ctx)
		require.NoError(t, err)
		defer func() { _ = conn.Close() }()
		// MariaDB >= 10.6.18 / 10.11.8 has it (on by default from 11.8).
		_, err = conn.ExecContext(ctx, "SET SESSION innodb_snapshot_isolation = ON")
		require.NoError(t, err)
		tx, err := conn.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelRepeatableRead})
		require.NoError(t, err)
		defer func() { _ = tx.Rollback() }()
		var v int
		require.NoError(t, tx.QueryRowContext(ctx, "SELECT v FROM t WHERE id = 2").Scan(&v))
		_, err = db.ExecContext(ctx, "UPDATE t SET v = v + 1 WHERE id = 2")
		require.NoError(t, err)
		_, err = tx.ExecContext(ctx, "UPDATE t SET v = v + 10 WHERE id = 2")
		require.Error(t, err)
		n, _ := pgerr.MySQLNumber(err)
		require.Equal(t, uint16(1020), n, "%v", err)
		require.True(t, pgerr.SerializationFailure(err), "%v", err)
		require.False(t, pgerr.Deterministic(err), "%v", err)
	})

	t.Run("killed connection", func(t *testing.T) {
		conn, err := db.Conn(ctx)
		require.NoError(t, err)
		defer func() { _ = conn.Close() }()
		var id int64
		require.NoError(t, conn.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&id))
		_, err = db.ExecContext(ctx, "KILL CONNECTION "+strconv.FormatInt(id, 10))
		require.NoError(t, err)
		_, err = conn.ExecContext(ctx, "SELECT 1")
		require.Error(t, err)
		t.Logf("after KILL: %T %v", err, err)
		require.True(t, pgerr.Unreachable(err), "%v", err)
		require.False(t, pgerr.Deterministic(err), "%v", err)
		require.False(t, pgerr.CommitRefused(err), "%v", err)
	})

	t.Run("killed before commit", func(t *testing.T) {
		tx, err := db.BeginTx(ctx, nil)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback() }()
		var id int64
		require.NoError(t, tx.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&id))
		_, err = tx.ExecContext(ctx, "INSERT INTO t (id, v) VALUES (30, 0)")
		require.NoError(t, err)
		_, err = db.ExecContext(ctx, "KILL CONNECTION "+strconv.FormatInt(id, 10))
		require.NoError(t, err)
		err = tx.Commit()
		require.Error(t, err)
		t.Logf("COMMIT after KILL: %T %v", err, err)
		require.True(t, pgerr.Unreachable(err), "%v", err)
		require.False(t, pgerr.CommitRefused(err), "%v", err)
		var rows int
		require.NoError(t, db.QueryRowContext(ctx, "SELECT count(*) FROM t WHERE id = 30").Scan(&rows))
		require.Zero(t, rows)
	})
}

// A port nothing listens on, and one that accepts and never answers: the
// database is unreachable.
func TestMySQLConnectErrorsAreUnreachable(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closed := ln.Addr().String()
	require.NoError(t, ln.Close())
	db, err := sql.Open("mysql", "root@tcp("+closed+")/test?parseTime=true&timeout=5s")
	require.NoError(t, err)
	defer func() { _ = db.Close() }()
	err = db.PingContext(ctx)
	require.Error(t, err)
	t.Logf("dial refused: %T %v", err, err)
	require.True(t, pgerr.Unreachable(err), "dial refused: %v", err)
	require.False(t, pgerr.CommitRefused(err), "%v", err)

	hole, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = hole.Close() }()
	go func() {
		for {
			c, err := hole.Accept()
			if err != nil {
				return
			}
			defer func() { _ = c.Close() }()
		}
	}()
	db2, err := sql.Open("mysql", "root@tcp("+hole.Addr().String()+")/test?parseTime=true&timeout=1s&readTimeout=1s")
	require.NoError(t, err)
	defer func() { _ = db2.Close() }()
	err = db2.PingContext(ctx)
	require.Error(t, err)
	t.Logf("no answer: %T %v", err, err)
	require.True(t, pgerr.Unreachable(err), "no answer: %v", err)
}
