package outboxdb_test

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Every MySQL statement renders for a table set, and MariaDB accepts it: a
// server-side PREPARE parses it and resolves every table and column, so a
// typo in a .sql file of queries/mysql fails here.
func TestStatementsPrepareMySQL(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn := testenv.MySQLDB(t)
	db := testenv.SchemaMySQL(t, wsql.BeginnerFromStdSQL(conn))
	s, err := outboxdb.New(db)
	require.NoError(t, err)
	all := s.Statements()
	require.NotEmpty(t, all)
	for _, st := range all {
		require.NotContains(t, st.SQL, "{{", "%s: rendered", st.Name)
		require.NotContains(t, st.SQL, "$1", "%s: MySQL's placeholders are ?", st.Name)
		p, err := conn.PrepareContext(ctx, st.SQL)
		require.NoError(t, err, "%s:\n%s", st.Name, st.SQL)
		require.NoError(t, p.Close())
	}
}

// LibraryTables finds, in information_schema, the inbox and outbox tables
// of a migrated database (with the migrations table), and of a database
// whose tables another tool created from 'migrate sql' (no migrations
// table: the later columns tell them); not a user's table of the same
// first columns, nor the parked and key-lock tables.
func TestLibraryTablesMySQL(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, migrated := testenv.MySQLDatabase(t)
	_, bare := testenv.MySQLDatabase(t)
	db := sqlschema.DB{Conn: wsql.BeginnerFromStdSQL(conn), Dialect: sqlschema.MySQL, Schema: migrated}
	require.NoError(t, sqlschema.Migrate(ctx, db))
	q := func(query string) {
		t.Helper()
		_, err := conn.ExecContext(ctx, query)
		require.NoError(t, err, query)
	}
	// bare: the library's shapes without the migrations table, and a
	// user's table with the outbox's first columns only.
	q("CREATE TABLE " + testenv.QuoteMySQL(bare) + ".`my_inbox` (consumer VARBINARY(10), message_key VARBINARY(10), status TEXT, attempts INT, first_seen_at DATETIME, processed_at DATETIME, lease_token TEXT)")
	q("CREATE TABLE " + testenv.QuoteMySQL(bare) + ".`my_outbox` (id BIGINT, topic TEXT, uuid TEXT, payload BLOB, metadata TEXT, created_at DATETIME, quarantined_at DATETIME)")
	q("CREATE TABLE " + testenv.QuoteMySQL(bare) + ".`events` (id BIGINT, topic TEXT, uuid TEXT, payload BLOB, metadata TEXT, created_at DATETIME)")
	q("CREATE VIEW " + testenv.QuoteMySQL(bare) + ".`outbox_view` AS SELECT * FROM " + testenv.QuoteMySQL(bare) + ".`my_outbox`")

	s, err := outboxdb.New(db)
	require.NoError(t, err)
	found, err := s.LibraryTables(ctx, db.Conn)
	require.NoError(t, err)
	var got []outboxdb.LibraryTable
	for _, tb := range found {
		if tb.Schema == migrated || tb.Schema == bare {
			got = append(got, tb)
		}
	}
	want := []outboxdb.LibraryTable{
		{Schema: migrated, Name: "watermill_inbox", Inbox: true},
		{Schema: migrated, Name: "watermill_outbox"},
		{Schema: bare, Name: "my_inbox", Inbox: true},
		{Schema: bare, Name: "my_outbox"},
	}
	if bare < migrated {
		want = append(want[2:], want[:2]...)
	}
	require.Equal(t, want, got)
}

// MySQL has no relay sessions to list (no LISTEN lock): Relays says so
// rather than failing on a statement it lacks.
func TestRelaysUnsupportedMySQL(t *testing.T) {
	t.Parallel()
	s, err := outboxdb.New(sqlschema.DB{Dialect: sqlschema.MySQL})
	require.NoError(t, err)
	_, err = s.Relays(t.Context(), nil)
	require.ErrorIs(t, err, sqlschema.ErrUnsupported)
}
