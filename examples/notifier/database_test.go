package main

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestDialectOf(t *testing.T) {
	require.Equal(t, sqlschema.MySQL, dialectOf("mysql://root@127.0.0.1:3306/test"))
	require.Equal(t, sqlschema.MySQL, dialectOf("MySQL://root@db/test"))
	require.Equal(t, sqlschema.Postgres, dialectOf("postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	require.Equal(t, sqlschema.Postgres, dialectOf("postgresql://u@h/db"))
	require.Equal(t, sqlschema.Postgres, dialectOf("host=127.0.0.1 user=postgres dbname=test"))
}

func TestMySQLConfig(t *testing.T) {
	cfg, err := mysqlConfig("mysql://root@127.0.0.1:3306/test")
	require.NoError(t, err)
	require.Equal(t, "root", cfg.User)
	require.Empty(t, cfg.Passwd)
	require.Equal(t, "tcp", cfg.Net)
	require.Equal(t, "127.0.0.1:3306", cfg.Addr)
	require.Equal(t, "test", cfg.DBName)
	require.True(t, cfg.ParseTime, "parseTime=true unless the URL says otherwise")
	require.Equal(t, time.UTC, cfg.Loc)

	// A password with the characters a DSN string would trip on, the
	// default port, the driver's parameters and a system variable kept.
	cfg, err = mysqlConfig("mysql://app:p%40ss%3Aw%2Fd%29@db.internal/notifier?timeout=5s&tx_isolation=%27READ-COMMITTED%27")
	require.NoError(t, err)
	require.Equal(t, "app", cfg.User)
	require.Equal(t, "p@ss:w/d)", cfg.Passwd)
	require.Equal(t, "db.internal:3306", cfg.Addr)
	require.Equal(t, "notifier", cfg.DBName)
	require.Equal(t, 5*time.Second, cfg.Timeout)
	require.Equal(t, "'READ-COMMITTED'", cfg.Params["tx_isolation"])
	require.True(t, cfg.ParseTime)

	cfg, err = mysqlConfig("mysql://[::1]:3307/x?loc=Local&parseTime=true")
	require.NoError(t, err)
	require.Equal(t, "[::1]:3307", cfg.Addr)
	require.Equal(t, time.Local, cfg.Loc, "the URL's loc is kept")

	_, err = mysqlConfig("mysql://root@127.0.0.1/test?parseTime=false")
	require.ErrorContains(t, err, "parseTime=true")
	_, err = mysqlConfig("mysql://root@127.0.0.1/test?timeout=soon")
	require.Error(t, err)
}

// TestStatements renders the notifier's statements for both dialects: every
// name is there, the tables are quoted per dialect, the placeholders are the
// dialect's.
func TestStatements(t *testing.T) {
	pg, err := loadStatements(sqlschema.DB{Schema: "notifier"})
	require.NoError(t, err)
	my, err := loadStatements(sqlschema.DB{Dialect: sqlschema.MySQL, Schema: "notifier"})
	require.NoError(t, err)
	require.Contains(t, pg["RecordSent"], `"notifier"."notification_log"`)
	require.Contains(t, my["RecordSent"], "`notifier`.`notification_log`")
	require.Equal(t, `DROP SCHEMA IF EXISTS "notifier" CASCADE`, pg["DropSchema"])
	require.Equal(t, "DROP DATABASE IF EXISTS `notifier`", my["DropSchema"])
	require.NotEmpty(t, pg["MigrateLock"])
	for _, name := range queryNames {
		require.NotContains(t, my[name], "$", name)
		require.Equal(t, strings.Count(pg[name], "$"), strings.Count(my[name], "?"), "%s: the same parameters", name)
	}
}
