package sqlschema_test

import (
	"database/sql"
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The MySQL dialect's configuration errors: what cannot hold on the engine
// is refused before anything runs, with an error that says so.
func TestMySQLRefusals(t *testing.T) {
	t.Parallel()
	conn := wsql.BeginnerFromStdSQL(testenv.MySQLDB(t))
	ctx := ctxT(t)

	partitioned := sqlschema.DB{Conn: conn, Dialect: sqlschema.MySQL, Partitions: &sqlschema.Partitioning{}}
	require.ErrorIs(t, partitioned.Validate(), sqlschema.ErrUnsupported)
	require.ErrorContains(t, sqlschema.Migrate(ctx, partitioned), "the time-partitioned inbox is PostgreSQL only")

	// A MySQL connection with the dialect left empty.
	err := sqlschema.Migrate(ctx, sqlschema.DB{Conn: conn, Schema: freshSchema(t, conn)})
	require.ErrorContains(t, err, "set DB.Dialect to sqlschema.MySQL")

	// The MySQL dialect over a pgx pool.
	err = sqlschema.Check(ctx, sqlschema.DB{Conn: wsql.BeginnerFromPgx(testenv.Pool(t)), Dialect: sqlschema.MySQL})
	require.ErrorContains(t, err, "must be wsql.BeginnerFromStdSQL(db)")

	require.ErrorContains(t, sqlschema.DB{Dialect: "oracle"}.Validate(), `DB.Dialect is "oracle"`)
}

// A DSN without parseTime=true would hand DATETIME columns over as bytes:
// Migrate and Check refuse it instead of failing later in a scan.
func TestMySQLNeedsParseTime(t *testing.T) {
	t.Parallel()
	mc, err := mysql.ParseDSN(testenv.MySQLDSN(testenv.MySQLURL()))
	require.NoError(t, err)
	mc.ParseTime = false
	db, err := sql.Open("mysql", mc.FormatDSN())
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	cfg := sqlschema.DB{Conn: wsql.BeginnerFromStdSQL(db), Dialect: sqlschema.MySQL, Schema: freshSchema(t, wsql.BeginnerFromStdSQL(db))}
	err = sqlschema.Migrate(ctxT(t), cfg)
	require.ErrorIs(t, err, sqlschema.ErrEngine)
	require.ErrorContains(t, err, "parseTime=true")
	require.ErrorIs(t, sqlschema.Check(ctxT(t), cfg), sqlschema.ErrEngine)
}

// Two table sets in one MySQL database, and the default Schema (the
// connection's database) next to an explicit one.
func TestMySQLTwoTableSetsAndTheConnectionsDatabase(t *testing.T) {
	t.Parallel()
	sdb, name := testenv.MySQLDatabase(t)
	conn := wsql.BeginnerFromStdSQL(sdb)
	ctx := ctxT(t)
	a := sqlschema.DB{Conn: conn, Dialect: sqlschema.MySQL, InboxTable: "inbox_a", OutboxTable: "outbox_a"}
	b := sqlschema.DB{Conn: conn, Dialect: sqlschema.MySQL, Schema: name, InboxTable: "inbox_b", OutboxTable: "outbox_b"}
	require.Equal(t, "`inbox_a`", a.Inbox(), "no schema: the connection's database")
	require.NoError(t, sqlschema.Migrate(ctx, a))
	require.True(t, tableExists(t, conn, name, "inbox_a"))
	require.False(t, tableExists(t, conn, name, "inbox_b"))
	require.NoError(t, sqlschema.Migrate(ctx, b))
	require.True(t, tableExists(t, conn, name, "outbox_b_key_locks"))
	require.NoError(t, sqlschema.Check(ctx, a))
	require.NoError(t, sqlschema.Check(ctx, b))
	st, err := sqlschema.Status(ctx, b)
	require.NoError(t, err)
	for _, m := range st {
		require.True(t, m.Applied, m.Name)
	}
	// A table that is not InnoDB has no transactions: Check refuses it.
	for _, q := range []string{"DROP TABLE `inbox_a`", "CREATE TABLE `inbox_a` (x INT) ENGINE = MyISAM"} {
		_, err = conn.ExecContext(ctx, q)
		require.NoError(t, err)
	}
	require.ErrorIs(t, sqlschema.Check(ctx, a), sqlschema.ErrEngine)
}

// clientFoundRows=true makes an upsert that changes nothing report one
// affected row, as an insert: the claims would take an existing record for
// a new one. Migrate, Check and CheckConn refuse the connection.
func TestMySQLRefusesClientFoundRows(t *testing.T) {
	t.Parallel()
	mc, err := mysql.ParseDSN(testenv.MySQLDSN(testenv.MySQLURL()))
	require.NoError(t, err)
	mc.ClientFoundRows = true
	db, err := sql.Open("mysql", mc.FormatDSN())
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	conn := wsql.BeginnerFromStdSQL(db)
	cfg := sqlschema.DB{Conn: conn, Dialect: sqlschema.MySQL, Schema: freshSchema(t, conn)}
	err = sqlschema.Migrate(ctxT(t), cfg)
	require.ErrorIs(t, err, sqlschema.ErrEngine)
	require.ErrorContains(t, err, "clientFoundRows")
	require.ErrorIs(t, sqlschema.CheckConn(ctxT(t), cfg), sqlschema.ErrEngine)

	good := sqlschema.DB{Conn: wsql.BeginnerFromStdSQL(testenv.MySQLDB(t)), Dialect: sqlschema.MySQL}
	require.NoError(t, sqlschema.CheckConn(ctxT(t), good))
	require.NoError(t, sqlschema.CheckConn(ctxT(t), sqlschema.DB{Conn: wsql.BeginnerFromPgx(testenv.Pool(t))}), "nothing to check on PostgreSQL")
}
