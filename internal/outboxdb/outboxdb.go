// Package outboxdb is the outbox's storage layer: every statement the
// outbox runs (the writers' INSERT and NOTIFY, the relay's batch, its
// failures and its LISTEN session, the operator's reads and actions on
// rows, the backlog's statistics), each a method with typed parameters and
// results. The statements live in queries/<dialect>/*.sql (postgres,
// mysql), rendered once per table set by New (internal/sqlfile); values always travel as
// parameters, so each operation is one statement whatever its arguments
// (a batch's size, a filter's fields).
//
// The methods run on the executor they are given (a transaction, a pool,
// a *sql.DB through watermill-sql's seam; the LISTEN session's statements
// on a pgx connection), and wrap no error: the callers say what failed.
package outboxdb

import (
	"embed"
	"fmt"
	"strings"
	"text/template"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlfile"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

//go:embed queries
var queries embed.FS

// dir is the directory of a dialect's statements: queries/postgres,
// queries/mysql.
func dir(d sqlschema.Dialect) string { return "queries/" + d.String() }

// migrationsTable is the table in which sqlschema.Migrate records the
// migrations it applied (sqlschema's migrationsTable).
const migrationsTable = "watermill_exactlyonce_migrations"

// Store runs the statements of one outbox table.
type Store struct {
	dialect sqlschema.Dialect
	st      sqlfile.Statements
	rows    map[string]sqlfile.Statements // rows/*.sql, by the filter's state
	table   string                        // quoted and schema-qualified
	// db names the table set (defaults applied): its dialect, and the
	// unquoted names the catalog queries take.
	db sqlschema.DB
	// perCount are the statements rendered per call for its number of
	// rows (MySQL's Insert and LockKeys: write.sql), by name; data is
	// what they are rendered with.
	perCount map[string]*template.Template
	data     tables
}

// tables is what the statements are rendered with.
type tables struct {
	// Outbox is the outbox table, quoted and schema-qualified.
	Outbox string
	// OutboxKeyLocks is MySQL's table of the ordering keys' locks
	// (<outbox>_key_locks), quoted and schema-qualified.
	OutboxKeyLocks string
	// Rows is the number of rows of a statement whose VALUES list has one
	// tuple per row (MySQL's Insert and LockKeys): 1 when New renders it,
	// the call's when Store.Insert does.
	Rows int
	// Channel is the table's NOTIFY channel as an SQL string literal;
	// ChannelIdent as an identifier (LISTEN's).
	Channel, ChannelIdent string
	// ListenerLockClass is outboxnotify.ListenerLockClass.
	ListenerLockClass int64
	// MigrationsTable is the name of sqlschema's migrations table.
	MigrationsTable string
	// FailingIndex is the outbox table's index of its failed rows, quoted
	// (the MySQL relay's DueHeads names it).
	FailingIndex string
	// State is the filter's state, and RowFilter the condition of
	// include/row_filter.sql for it (rows/*.sql).
	State, RowFilter string
}

// New renders the statements of db's outbox table. It does not touch the
// database; db.Conn is not used.
func New(db sqlschema.DB) (*Store, error) {
	if err := db.Validate(); err != nil {
		return nil, err
	}
	db = db.WithDefaults()
	channel := outboxnotify.Channel(db)
	data := tables{
		Outbox:            db.Outbox(),
		OutboxKeyLocks:    db.Dialect.QuoteIdentifier(db.Schema, db.OutboxTable+keyLocksSuffix),
		Rows:              1,
		Channel:           "'" + strings.ReplaceAll(channel, "'", "''") + "'",
		ChannelIdent:      db.Dialect.QuoteIdentifier(channel),
		ListenerLockClass: outboxnotify.ListenerLockClass,
		MigrationsTable:   migrationsTable,
		FailingIndex:      db.Dialect.QuoteIdentifier(db.WithDefaults().OutboxTable + "_failing"),
	}
	st, err := sqlfile.Render(queries, dir(db.Dialect), data)
	if err != nil {
		return nil, err
	}
	s := &Store{dialect: db.Dialect, st: st, rows: map[string]sqlfile.Statements{}, table: data.Outbox, db: db, data: data}
	if s.perCount, err = parsePerCount(dir(db.Dialect)); err != nil {
		return nil, err
	}
	for _, state := range []string{StateQuarantined, StateFailing, StateAll} {
		data.State = state
		if data.RowFilter, err = include(dir(db.Dialect), "row_filter.sql", "RowFilter", data); err != nil {
			return nil, err
		}
		if s.rows[state], err = sqlfile.Render(queries, dir(db.Dialect)+"/rows", data); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// include renders the condition called name of the file include/file: a
// part of several statements, written once.
func include(dir, file, name string, data tables) (string, error) {
	src, err := queries.ReadFile(dir + "/include/" + file)
	if err != nil {
		return "", err
	}
	parsed, err := sqlfile.Parse(src)
	if err != nil {
		return "", fmt.Errorf("sqlfile: %s: %w", file, err)
	}
	for _, st := range parsed {
		if st.Name == name {
			return sqlfile.Execute(st, data)
		}
	}
	return "", fmt.Errorf("sqlfile: %s defines no %q", file, name)
}

// Table returns the outbox table, quoted and schema-qualified.
func (s *Store) Table() string { return s.table }

// Statement is a rendered statement.
type Statement struct {
	// Name is the statement's name; for a statement of rows/*.sql, its
	// name, "/" and the filter's state.
	Name string
	SQL  string
}

// Statements returns every statement rendered for the table set, by name
// (the test that PREPAREs them all reads them).
func (s *Store) Statements() []Statement {
	var out []Statement
	for _, name := range s.st.Names() {
		out = append(out, Statement{name, s.st.Get(name)})
	}
	for _, state := range []string{StateQuarantined, StateFailing, StateAll} {
		for _, name := range s.rows[state].Names() {
			out = append(out, Statement{name + "/" + state, s.rows[state].Get(name)})
		}
	}
	return out
}
