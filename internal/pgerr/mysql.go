package pgerr

import (
	"errors"
	"strings"

	"github.com/go-sql-driver/mysql"
)

// MySQL and MariaDB share the error numbers below 1900 and the client's
// 2000-2999; above that MySQL uses 3000-3999 (MariaDB leaves them unused)
// and both use 4000 and up for different errors. The tables below name
// which server each number past 1900 comes from; a number both use
// differently (4025, 4031) is decided by its SQLSTATE or left out.

// mysqlUnreachable are the error numbers that say the server cannot be
// reached or cannot take work now.
var mysqlUnreachable = map[uint16]bool{
	1040: true, // ER_CON_COUNT_ERROR: too many connections (08004)
	1203: true, // ER_TOO_MANY_USER_CONNECTIONS: max_user_connections (42000)
	1053: true, // ER_SERVER_SHUTDOWN: server shutdown in progress (08S01)
	1047: true, // ER_UNKNOWN_COM_ERROR: a Galera node not ready ("WSREP has not yet prepared node") (08S01)
	1152: true, // ER_ABORTING_CONNECTION (08S01)
	1184: true, // ER_NEW_ABORTING_CONNECTION (08S01)
	1154: true, // ER_NET_READ_ERROR_FROM_PIPE (08S01)
	1158: true, // ER_NET_READ_ERROR (08S01)
	1159: true, // ER_NET_READ_INTERRUPTED (08S01)
	1160: true, // ER_NET_ERROR_ON_WRITE (08S01)
	1161: true, // ER_NET_WRITE_INTERRUPTED (08S01)
	1927: true, // ER_CONNECTION_KILLED, MariaDB: KILL CONNECTION (70100)
	3032: true, // ER_SERVER_OFFLINE_MODE, MySQL: offline_mode is on
	2002: true, // CR_CONNECTION_ERROR (client library or a proxy): cannot connect through the socket
	2003: true, // CR_CONN_HOST_ERROR: cannot connect to the host
	2005: true, // CR_UNKNOWN_HOST
	2006: true, // CR_SERVER_GONE_ERROR: server has gone away
	2013: true, // CR_SERVER_LOST: lost connection during query
	2055: true, // CR_SERVER_LOST_EXTENDED
}

// mysqlSerialization are the error numbers after which a new transaction
// may succeed.
var mysqlSerialization = map[uint16]bool{
	1213: true, // ER_LOCK_DEADLOCK (40001): InnoDB rolled the whole transaction back
	1205: true, // ER_LOCK_WAIT_TIMEOUT: InnoDB rolled back the statement (the transaction with innodb_rollback_on_timeout)
	1020: true, // ER_CHECKREAD: MariaDB innodb_snapshot_isolation, the row changed after the snapshot
	1412: true, // ER_TABLE_DEF_CHANGED: the table changed after the consistent snapshot
	3101: true, // ER_TRANSACTION_ROLLBACK_DURING_COMMIT, MySQL: group replication certification conflict (40000)
}

// mysqlDeterministic are error numbers that repeat when the same work is
// done again, besides those whose SQLSTATE has a Deterministic class (they
// are listed here too, for a server that sends no SQLSTATE, where the
// SQLSTATE is the catch-all HY000, and where MariaDB and MySQL disagree on
// it).
var mysqlDeterministic = map[uint16]bool{
	1022: true, // ER_DUP_KEY
	1044: true, // ER_DBACCESS_DENIED_ERROR
	1048: true, // ER_BAD_NULL_ERROR
	1050: true, // ER_TABLE_EXISTS_ERROR
	1054: true, // ER_BAD_FIELD_ERROR: unknown column
	1060: true, // ER_DUP_FIELDNAME
	1061: true, // ER_DUP_KEYNAME
	1062: true, // ER_DUP_ENTRY
	1064: true, // ER_PARSE_ERROR
	1142: true, // ER_TABLEACCESS_DENIED_ERROR
	1146: true, // ER_NO_SUCH_TABLE
	1153: true, // ER_NET_PACKET_TOO_LARGE: the same packet is too large again (08S01)
	1169: true, // ER_DUP_UNIQUE
	1216: true, // ER_NO_REFERENCED_ROW
	1217: true, // ER_ROW_IS_REFERENCED
	1227: true, // ER_SPECIFIC_ACCESS_DENIED_ERROR
	1264: true, // ER_WARN_DATA_OUT_OF_RANGE
	1265: true, // WARN_DATA_TRUNCATED as an error in strict mode (01000)
	1290: true, // ER_OPTION_PREVENTS_STATEMENT: --read-only, --super-read-only, --secure-file-priv
	1292: true, // ER_TRUNCATED_WRONG_VALUE
	1356: true, // ER_VIEW_INVALID
	1364: true, // ER_NO_DEFAULT_FOR_FIELD
	1365: true, // ER_DIVISION_BY_ZERO
	1366: true, // ER_TRUNCATED_WRONG_VALUE_FOR_FIELD (MySQL HY000, MariaDB 22007)
	1406: true, // ER_DATA_TOO_LONG
	1411: true, // ER_WRONG_VALUE_FOR_TYPE
	1451: true, // ER_ROW_IS_REFERENCED_2
	1452: true, // ER_NO_REFERENCED_ROW_2
	1586: true, // ER_DUP_ENTRY_WITH_KEY_NAME
	1644: true, // ER_SIGNAL_EXCEPTION: an unhandled SIGNAL (like PostgreSQL's RAISE, P0001)
	1690: true, // ER_DATA_OUT_OF_RANGE
	1792: true, // ER_CANT_EXECUTE_IN_READ_ONLY_TRANSACTION (25006)
	1836: true, // ER_READ_ONLY_MODE
	1874: true, // ER_INNODB_READ_ONLY
	3819: true, // ER_CHECK_CONSTRAINT_VIOLATED, MySQL (MariaDB: 4025, 23000)
}

// mysqlNotDeterministic are error numbers whose SQLSTATE has a Deterministic
// class but that are not: they are decided as their PostgreSQL counterparts
// are.
var mysqlNotDeterministic = map[uint16]bool{
	1049: true, // ER_BAD_DB_ERROR, unknown database (42000): like 3D000
}

// mysqlUnique are the error numbers of a unique or primary key violation.
var mysqlUnique = map[uint16]bool{
	1022: true, // ER_DUP_KEY
	1062: true, // ER_DUP_ENTRY
	1169: true, // ER_DUP_UNIQUE
	1586: true, // ER_DUP_ENTRY_WITH_KEY_NAME
}

// mysqlRefusedAtCommit are the error numbers, besides the Deterministic and
// SerializationFailure ones, with which MySQL refuses a COMMIT and rolls the
// transaction back.
var mysqlRefusedAtCommit = map[uint16]bool{
	1180: true, // ER_ERROR_DURING_COMMIT: the storage engine or binary log refused the commit
}

// mysqlUndefined are the error numbers of a statement naming a table or
// column the database does not have (a table in a missing database is 1146
// too).
var mysqlUndefined = map[uint16]bool{
	1146: true, // ER_NO_SUCH_TABLE (42S02)
	1054: true, // ER_BAD_FIELD_ERROR (42S22)
}

// mysqlError returns the outermost *mysql.MySQLError in err's chain.
func mysqlError(err error) (*mysql.MySQLError, bool) {
	var me *mysql.MySQLError
	if err == nil || !errors.As(err, &me) || me == nil {
		return nil, false
	}
	return me, true
}

// mysqlState is me's SQLSTATE, or "" when the server sent none.
func mysqlState(me *mysql.MySQLError) string {
	if me.SQLState == [5]byte{} {
		return ""
	}
	return string(me.SQLState[:])
}

// MySQLNumber returns the error number of the outermost *mysql.MySQLError
// in err's chain (1062 for a duplicate key, 1213 for a deadlock), and false
// when err has none.
func MySQLNumber(err error) (uint16, bool) {
	me, ok := mysqlError(err)
	if !ok {
		return 0, false
	}
	return me.Number, true
}

func mysqlIsDeterministic(me *mysql.MySQLError) bool {
	n := me.Number
	if mysqlUnreachable[n] || mysqlSerialization[n] || mysqlNotDeterministic[n] {
		return false
	}
	if mysqlDeterministic[n] {
		return true
	}
	s := mysqlState(me)
	return len(s) == 5 && deterministicClasses[s[:2]]
}

// mysqlIsReadOnly reports whether me refuses a write because the server or
// the transaction is read-only. 1290 is also --secure-file-priv's refusal,
// so only its read-only messages count.
func mysqlIsReadOnly(me *mysql.MySQLError) bool {
	switch me.Number {
	case 1792, 1836, 1874:
		return true
	case 1290:
		m := strings.ToLower(me.Message)
		return strings.Contains(m, "read-only") || strings.Contains(m, "read_only")
	}
	return false
}
