package sqlschema_test

import (
	"context"
	"database/sql"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// migrationsTable is the table Migrate records its work in, in DB.Schema:
// part of the contract (operators and migration tools see it).
const migrationsTable = "watermill_exactlyonce_migrations"

// Default table names (sqlschema.DB{}.WithDefaults()).
const (
	defaultInboxTable  = "watermill_inbox"
	defaultOutboxTable = "watermill_outbox"
)

// eachEngine runs f once per driver of either engine
// (testenv.ForEachEngine): PostgreSQL's two and MariaDB.
func eachEngine(t *testing.T, f func(t *testing.T, d testenv.Driver)) {
	t.Helper()
	testenv.ForEachEngine(t, nil, func(t *testing.T, d testenv.Driver, _ string) { f(t, d) })
}

// isMySQL reports whether db reaches MySQL/MariaDB (go-sql-driver/mysql).
func isMySQL(db wsql.ContextExecutor) bool {
	b, ok := db.(wsql.StdSQLBeginner)
	if !ok {
		return false
	}
	sdb, ok := b.SQLBeginner.(*sql.DB)
	return ok && strings.HasSuffix(fmt.Sprintf("%T", sdb.Driver()), "mysql.MySQLDriver")
}

// sqlFor returns pg or mysql, the text of a test's own statement for db.
func sqlFor(db wsql.ContextExecutor, pg, mysql string) string {
	if isMySQL(db) {
		return mysql
	}
	return pg
}

// eachDriver runs f once per driver (testenv.ForEachDriver).
func eachDriver(t *testing.T, f func(t *testing.T, d testenv.Driver)) {
	t.Helper()
	testenv.ForEachDriver(t, nil, func(t *testing.T, d testenv.Driver, _ string) { f(t, d) })
}

// freshSchema returns a unique schema name that does not exist yet, and
// drops the schema (if something created it) at cleanup.
func freshSchema(t *testing.T, db wsql.ContextExecutor) string {
	t.Helper()
	return freshSchemaNamed(t, db, testenv.Unique(t, "eo_"))
}

func freshSchemaNamed(t *testing.T, db wsql.ContextExecutor, name string) string {
	t.Helper()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		drop := sqlFor(db, "DROP SCHEMA IF EXISTS "+pgx.Identifier{name}.Sanitize()+" CASCADE", "DROP DATABASE IF EXISTS "+testenv.QuoteMySQL(name))
		if _, err := db.ExecContext(ctx, drop); err != nil {
			t.Errorf("dropping schema %s: %v", name, err)
		}
	})
	return name
}

func ctxT(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// tableExists reports whether schema.table exists, with exact (case
// sensitive) names.
func tableExists(t *testing.T, db wsql.ContextExecutor, schema, table string) bool {
	t.Helper()
	var n int
	require.NoError(t, seam.QueryRow(context.Background(), db,
		sqlFor(db, "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = $2",
			"SELECT count(*) FROM information_schema.tables WHERE table_schema = ? AND table_name = ?"),
		[]any{schema, table}, &n))
	return n == 1
}

func schemaExists(t *testing.T, db wsql.ContextExecutor, schema string) bool {
	t.Helper()
	var n int
	require.NoError(t, seam.QueryRow(context.Background(), db,
		sqlFor(db, "SELECT count(*) FROM pg_namespace WHERE nspname = $1",
			"SELECT count(*) FROM information_schema.schemata WHERE schema_name = ?"), []any{schema}, &n))
	return n == 1
}

// queryStrings returns the first column of every row of q as text.
func queryStrings(t *testing.T, db wsql.ContextExecutor, q string, args ...any) []string {
	t.Helper()
	rows, err := db.QueryContext(context.Background(), q, args...)
	require.NoError(t, err)
	var out []string
	for rows.Next() {
		var s string
		require.NoError(t, rows.Scan(&s))
		out = append(out, s)
	}
	require.NoError(t, seam.Close(rows))
	return out
}

// migration is one migration of the script sqlschema.SQL returns.
type migration struct {
	Target  string // "inbox" or "outbox"
	Version int    // from 1, per target
	Name    string // the embedded file's name, as Migrate records it
	SQL     string // the statements, rendered for the DB's names
}

// migrationHeader is the comment SQL puts before each migration (the format
// is pinned by the internal TestSQLListsEveryMigration).
var migrationHeader = regexp.MustCompile(`(?m)^-- (\S+\.up\.sql) \(target (inbox|outbox), version ([0-9]+)\)\n`)

// scriptMigrations splits the public script of sqlschema.SQL(db) into its
// migrations, in the script's order: what Migrate applies and records.
func scriptMigrations(t *testing.T, db sqlschema.DB) []migration {
	t.Helper()
	script, err := sqlschema.SQL(db)
	require.NoError(t, err)
	heads := migrationHeader.FindAllStringSubmatchIndex(script, -1)
	require.NotEmpty(t, heads, "no migration header in the script of sqlschema.SQL")
	out := make([]migration, len(heads))
	for i, h := range heads {
		end := len(script)
		if i+1 < len(heads) {
			end = heads[i+1][0]
		}
		version, err := strconv.Atoi(script[h[6]:h[7]])
		require.NoError(t, err)
		out[i] = migration{Target: script[h[4]:h[5]], Version: version, Name: script[h[2]:h[3]], SQL: script[h[1]:end]}
	}
	return out
}
