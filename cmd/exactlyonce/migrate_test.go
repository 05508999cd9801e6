package main

import (
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

type migrateStatusJSON struct {
	Schema      string          `json:"schema"`
	InboxTable  string          `json:"inbox_table"`
	OutboxTable string          `json:"outbox_table"`
	UpToDate    bool            `json:"up_to_date"`
	Pending     int             `json:"pending"`
	Migrations  []migrationJSON `json:"migrations"`
}

type migrateUpJSON struct {
	Schema      string   `json:"schema"`
	InboxTable  string   `json:"inbox_table"`
	OutboxTable string   `json:"outbox_table"`
	Applied     []string `json:"applied"`
	Total       int      `json:"total"`
}

// migrationNamesOf are the names of every migration of this version for
// db's dialect, in the order Migrate applies them, read through db.Conn.
func migrationNamesOf(t *testing.T, db sqlschema.DB) []string {
	t.Helper()
	db.Schema = "no_such_schema_here"
	st, err := sqlschema.Status(testCtx(t), db)
	require.NoError(t, err)
	var names []string
	for _, m := range st {
		names = append(names, m.Name)
	}
	return names
}

// migrate status before and after migrate up, in text and JSON; up is
// idempotent; inbox and outbox commands refuse tables that are not
// migrated, saying what to run.
func TestMigrateUpAndStatus(t *testing.T) {
	t.Parallel()
	testenv.ForEachEngine(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
		testMigrateUpAndStatus(t, d)
	})
}

func testMigrateUpAndStatus(t *testing.T, d testenv.Driver) {
	// A schema with no tables: on PostgreSQL one that does not exist yet,
	// on MySQL a fresh database (the CLI's --schema).
	var schema string
	var env []string
	if d.Dialect == sqlschema.MySQL {
		_, schema = testenv.MySQLDatabase(t)
		env = []string{envDatabaseURL + "=" + testenv.MySQLURL(), envSchema + "=" + schema}
	} else {
		schema = freshSchema(t)
		env = dbEnv(schema)
	}
	names := migrationNamesOf(t, sqlschema.DB{Dialect: d.Dialect, Conn: d.DB})

	r := cli(t, env, "migrate", "status")
	requireOK(t, r)
	require.Contains(t, r.stdout, `Schema "`+schema+`"`)
	require.Contains(t, r.stdout, "run 'exactlyonce migrate up'")
	for _, n := range names {
		require.Regexp(t, n+` +pending\n`, r.stdout)
	}

	var st migrateStatusJSON
	decode(t, cli(t, env, "migrate", "status", "--json"), &st)
	require.Equal(t, schema, st.Schema)
	require.Equal(t, "watermill_inbox", st.InboxTable)
	require.Equal(t, "watermill_outbox", st.OutboxTable)
	require.False(t, st.UpToDate)
	require.Equal(t, len(names), st.Pending)
	require.Len(t, st.Migrations, len(names))
	for i, m := range st.Migrations {
		require.Equal(t, names[i], m.Name)
		require.False(t, m.Applied)
		require.Nil(t, m.AppliedAt)
	}

	// Whether 'migrate up' is the advice depends on the other schemas of
	// the shared database (TestTablesElsewhere tests both).
	for _, args := range [][]string{
		{"inbox", "stats"}, {"inbox", "parked"}, {"inbox", "show", "-c", "c", "k"},
		{"outbox", "stats"}, {"outbox", "pending"}, {"outbox", "requeue-failed"},
	} {
		requireExit(t, cli(t, env, args...), exitFailed, `no exactly-once tables in schema "`+schema+`"`)
	}

	before := time.Now()
	var up migrateUpJSON
	decode(t, cli(t, env, "migrate", "up", "--json"), &up)
	require.Equal(t, names, up.Applied)
	require.Equal(t, len(names), up.Total)
	require.Equal(t, schema, up.Schema)

	r = cli(t, env, "migrate", "up")
	requireOK(t, r)
	require.Contains(t, r.stdout, "Already up to date")
	decode(t, cli(t, env, "migrate", "up", "--json"), &up)
	require.Empty(t, up.Applied)
	require.NotNil(t, up.Applied, "[] rather than null")

	db := sqlschema.DB{Dialect: d.Dialect, Conn: d.DB, Schema: schema}
	require.NoError(t, sqlschema.Check(testCtx(t), db))

	decode(t, cli(t, env, "migrate", "status", "--json"), &st)
	require.True(t, st.UpToDate)
	require.Zero(t, st.Pending)
	for _, m := range st.Migrations {
		require.True(t, m.Applied, m.Name)
		require.NotNil(t, m.AppliedAt, m.Name)
		at, err := time.Parse(time.RFC3339Nano, *m.AppliedAt)
		require.NoError(t, err)
		require.WithinDuration(t, before, at, time.Minute)
	}
	r = cli(t, env, "migrate", "status")
	requireOK(t, r)
	require.Contains(t, r.stdout, "Up to date")
	require.NotContains(t, r.stdout, "pending")

	requireOK(t, cli(t, env, "inbox", "stats"))
}

// Table names from flags and from the environment, flags first; migrate sql
// prints sqlschema.SQL for them and needs no database.
func TestMigrateTableNames(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	schema := freshSchema(t)
	env := append(dbEnv(schema), envInboxTable+"=env_in", envOutboxTable+"=env_out")

	var up migrateUpJSON
	decode(t, cli(t, env, "migrate", "up", "--json", "--inbox-table", "flag_in"), &up)
	require.Equal(t, "flag_in", up.InboxTable, "the flag wins over the environment")
	require.Equal(t, "env_out", up.OutboxTable)
	pool := testenv.Pool(t)
	require.NoError(t, sqlschema.Check(testCtx(t), sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: schema, InboxTable: "flag_in", OutboxTable: "env_out"}))

	// Other names in the same schema are not migrated.
	requireExit(t, cli(t, env, "inbox", "stats"), exitFailed, `inbox table "env_in"`)
	requireOK(t, cli(t, env, "inbox", "stats", "--inbox-table", "flag_in"))

	want, err := sqlschema.SQL(sqlschema.DB{Schema: "other", InboxTable: "i", OutboxTable: "o"})
	require.NoError(t, err)
	r := cli(t, nil, "migrate", "sql", "--schema", "other", "--inbox-table", "i", "--outbox-table", "o")
	requireOK(t, r)
	require.Equal(t, want, r.stdout, "no database needed")

	var doc struct {
		Schema      string `json:"schema"`
		InboxTable  string `json:"inbox_table"`
		OutboxTable string `json:"outbox_table"`
		SQL         string `json:"sql"`
	}
	decode(t, cli(t, []string{envSchema + "=other", envInboxTable + "=i", envOutboxTable + "=o"}, "migrate", "sql", "--json"), &doc)
	require.Equal(t, want, doc.SQL)
	require.Equal(t, "other", doc.Schema)
}
