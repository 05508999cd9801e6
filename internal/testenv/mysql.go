package testenv

import (
	"context"
	"database/sql"
	"embed"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/mysqldsn"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlfile"
)

// mysqlQueries are testenv's statements on MySQL/MariaDB
// (queries/mysql/database.sql).
//
//go:embed queries/mysql
var mysqlQueries embed.FS

const mysqlHint = " (is the service running? `make services` starts it; MYSQL_URL overrides the loopback default)"

// MySQLURL is $MYSQL_URL, or the loopback default (MariaDB's root, no
// password, database test).
func MySQLURL() string {
	if u := os.Getenv("MYSQL_URL"); u != "" {
		return u
	}
	return "mysql://root@127.0.0.1:3306/test"
}

// MySQLDSN converts a mysql://user:password@host:port/database?params URL
// into a go-sql-driver/mysql DSN, user:password@tcp(host:port)/database?params.
// The URL's query parameters are kept; parseTime=true and loc=UTC are added
// unless the URL sets them (the library needs parseTime=true). The port
// defaults to 3306. A string that is not a mysql:// URL is returned as it is:
// it is taken for a DSN already.
func MySQLDSN(rawURL string) string {
	if !mysqldsn.IsURL(rawURL) {
		return rawURL
	}
	dsn, err := mysqldsn.FromURL(rawURL)
	if err != nil {
		return rawURL
	}
	return dsn
}

// MySQLDB returns a database/sql handle (go-sql-driver/mysql) to the test
// MySQL/MariaDB database (MySQLURL), closed at cleanup.
func MySQLDB(t testing.TB) *sql.DB {
	t.Helper()
	return MySQLDBFor(t, MySQLDSN(MySQLURL()))
}

// MySQLDBFor returns a database/sql handle (go-sql-driver/mysql) to dsn (at
// most 20 open connections), closed at cleanup. The test fails (never skips)
// when the server does not answer.
func MySQLDBFor(t testing.TB, dsn string) *sql.DB {
	t.Helper()
	db, err := sql.Open("mysql", dsn)
	require.NoError(t, err, "MySQL DSN "+mysqlRedacted(dsn))
	db.SetMaxOpenConns(20)
	t.Cleanup(func() { _ = db.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, db.PingContext(ctx), "MySQL at "+mysqlRedacted(dsn)+mysqlHint)
	return db
}

// MySQLDatabase creates a fresh database named Unique(t, "eo_") on the test
// server and returns a handle connected to it (MySQLDBFor) and its name. The
// database is dropped at cleanup, after the handle is closed.
func MySQLDatabase(t testing.TB) (*sql.DB, string) {
	t.Helper()
	dsn := MySQLDSN(MySQLURL())
	server := MySQLDBFor(t, dsn)
	name := Unique(t, "eo_")
	st, err := sqlfile.Render(mysqlQueries, "queries/mysql", struct{ Database string }{QuoteMySQL(name)})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err = server.ExecContext(ctx, st.Get("CreateDatabase"))
	require.NoError(t, err, "creating test database %s", name)
	// Registered before the handle's Close, so it runs after it.
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := server.ExecContext(ctx, st.Get("DropDatabase")); err != nil {
			t.Errorf("dropping test database %s: %v", name, err)
		}
	})
	cfg, err := mysql.ParseDSN(dsn)
	require.NoError(t, err, "MySQL DSN "+mysqlRedacted(dsn))
	cfg.DBName = name
	return MySQLDBFor(t, cfg.FormatDSN()), name
}

// QuoteMySQL quotes an identifier for MySQL/MariaDB: in backticks, a
// backtick doubled.
func QuoteMySQL(ident string) string {
	return "`" + strings.ReplaceAll(ident, "`", "``") + "`"
}

// mysqlRedacted is dsn without its password, for messages.
func mysqlRedacted(dsn string) string {
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return "(unparsable DSN)"
	}
	if cfg.Passwd != "" {
		cfg.Passwd = "xxxxx"
	}
	return cfg.FormatDSN()
}
