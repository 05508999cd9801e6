package testenv

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlfile"
)

func TestMySQLDSN(t *testing.T) {
	cases := []struct {
		url        string
		user, pass string
		addr, db   string
		parseTime  bool
		params     map[string]string
	}{
		{url: "mysql://root@127.0.0.1:3306/test", user: "root", addr: "127.0.0.1:3306", db: "test", parseTime: true},
		{url: "mysql://root@localhost/test", user: "root", addr: "localhost:3306", db: "test", parseTime: true},
		{url: "mysql://root@[::1]:3307/x", user: "root", addr: "[::1]:3307", db: "x", parseTime: true},
		{
			url:  "mysql://app:p%40ss%2Fw:rd@db.example:3307/app?parseTime=false&sql_mode=%27ANSI_QUOTES%27",
			user: "app", pass: "p@ss/w:rd", addr: "db.example:3307", db: "app",
			params: map[string]string{"sql_mode": "'ANSI_QUOTES'"},
		},
	}
	for _, c := range cases {
		t.Run(c.url, func(t *testing.T) {
			dsn := MySQLDSN(c.url)
			cfg, err := mysql.ParseDSN(dsn)
			require.NoError(t, err, dsn)
			assert.Equal(t, c.user, cfg.User, dsn)
			assert.Equal(t, c.pass, cfg.Passwd, dsn)
			assert.Equal(t, "tcp", cfg.Net, dsn)
			assert.Equal(t, c.addr, cfg.Addr, dsn)
			assert.Equal(t, c.db, cfg.DBName, dsn)
			assert.Equal(t, c.parseTime, cfg.ParseTime, dsn)
			assert.Equal(t, time.UTC, cfg.Loc, dsn)
			for k, v := range c.params {
				assert.Equal(t, v, cfg.Params[k], dsn)
			}
		})
	}
	// A DSN already is left alone.
	assert.Equal(t, "root@tcp(127.0.0.1:3306)/test?parseTime=true", MySQLDSN("root@tcp(127.0.0.1:3306)/test?parseTime=true"))
}

func TestMySQLDatabaseIsolated(t *testing.T) {
	var names [2]string
	t.Run("two", func(t *testing.T) {
		a, aName := MySQLDatabase(t)
		b, bName := MySQLDatabase(t)
		names = [2]string{aName, bName}
		require.NotEqual(t, aName, bName)

		table := "items"
		st, err := sqlfile.Render(os.DirFS("testdata"), "mysql", struct{ Table string }{QuoteMySQL(table)})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()

		var current string
		require.NoError(t, a.QueryRowContext(ctx, st.Get("CurrentDatabase")).Scan(&current))
		assert.Equal(t, aName, current)
		require.NoError(t, b.QueryRowContext(ctx, st.Get("CurrentDatabase")).Scan(&current))
		assert.Equal(t, bName, current)

		_, err = a.ExecContext(ctx, st.Get("CreateTable"))
		require.NoError(t, err)
		_, err = a.ExecContext(ctx, st.Get("Insert"), 1)
		require.NoError(t, err)
		var n int
		require.NoError(t, a.QueryRowContext(ctx, st.Get("CountRows")).Scan(&n))
		assert.Equal(t, 1, n)

		require.NoError(t, a.QueryRowContext(ctx, st.Get("TableExists"), table).Scan(&n))
		assert.Equal(t, 1, n, "the table in the database it was created in")
		require.NoError(t, b.QueryRowContext(ctx, st.Get("TableExists"), table).Scan(&n))
		assert.Equal(t, 0, n, "the table of the other database")
		err = b.QueryRowContext(ctx, st.Get("CountRows")).Scan(&n)
		var myErr *mysql.MySQLError
		require.ErrorAs(t, err, &myErr)
		assert.Equal(t, uint16(1146), myErr.Number, "no such table: %v", err) // ER_NO_SUCH_TABLE

		// parseTime=true: DATETIME scans into time.Time, in UTC.
		var now time.Time
		require.NoError(t, a.QueryRowContext(ctx, st.Get("Now")).Scan(&now))
		assert.Equal(t, time.UTC, now.Location())
		assert.WithinDuration(t, time.Now(), now, time.Minute)
	})

	st, err := sqlfile.Render(os.DirFS("testdata"), "mysql", struct{ Table string }{"unused"})
	require.NoError(t, err)
	server := MySQLDB(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, name := range names {
		require.NotEmpty(t, name)
		var n int
		require.NoError(t, server.QueryRowContext(ctx, st.Get("DatabaseExists"), name).Scan(&n))
		assert.Equal(t, 0, n, "database %s is dropped at cleanup", name)
	}
}

// The MariaDB driver of an isolation level has it as its sessions' default.
func TestMySQLDriverWithIsolation(t *testing.T) {
	for _, level := range IsolationLevels {
		d := MySQLDriverWithIsolation(t, level)
		var got string
		require.NoError(t, seam.QueryRow(context.Background(), d.DB, "SELECT @@tx_isolation", nil, &got))
		require.Equal(t, strings.ToUpper(strings.ReplaceAll(level, " ", "-")), got)
	}
}
