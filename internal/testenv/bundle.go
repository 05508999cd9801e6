package testenv

import (
	"context"
	"errors"
	"regexp"
	"strconv"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// BundleTimeout bounds a Bundle's context, and so every statement a test
// runs through it.
const BundleTimeout = 60 * time.Second

// Bundle is what a test of one driver works with (River-style: one value
// the setup returns, passed around instead of its parts): a context bounded
// by BundleTimeout, the driver, and a fresh migrated schema reached through
// that driver (DB.Conn is Driver.DB), dropped at cleanup.
type Bundle struct {
	Ctx    context.Context
	Driver Driver
	DB     sqlschema.DB
}

// NewBundle creates the bundle of driver d: a fresh schema with the inbox
// and outbox tables (Schema), reached through d.
func NewBundle(t testing.TB, d Driver) *Bundle {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), BundleTimeout)
	t.Cleanup(cancel)
	if d.Dialect == sqlschema.MySQL {
		return &Bundle{Ctx: ctx, Driver: d, DB: SchemaMySQL(t, d.DB)}
	}
	return &Bundle{Ctx: ctx, Driver: d, DB: WithConn(Schema(t), d.DB)}
}

// DriverNames are the names of the drivers Drivers returns, in its order.
var DriverNames = []string{"pgxpool", "database-sql"}

// DriverNamed returns the one driver named name (see DriverNames) to the
// test database, opening only that one.
func DriverNamed(t testing.TB, name string) Driver {
	t.Helper()
	switch name {
	case "pgxpool":
		return Driver{Name: name, DB: wsql.BeginnerFromPgx(Pool(t))}
	case "database-sql":
		return Driver{Name: name, DB: wsql.BeginnerFromStdSQL(StdDB(t))}
	case MariaDB:
		return Driver{Name: name, DB: wsql.BeginnerFromStdSQL(MySQLDB(t)), Dialect: sqlschema.MySQL}
	}
	t.Fatalf("unknown driver %q (want one of %v)", name, EngineDriverNames)
	return Driver{}
}

// ForEachDriver is the suite's driver matrix: it runs f once per driver
// (DriverNames, in that order) and, when variants is not empty, once per
// variant of each driver, as parallel subtests named "driver" or
// "driver/variant" ("pgxpool/plain"). The variants are usually the inbox
// layouts (Layouts, for SchemaLayout) and may be any other dimension (a
// middleware mode); f gets the variant, or "" without variants. The driver
// is opened inside the subtest, so that subtests waiting for their turn
// hold no connection. A package's own helper builds its bundle inside f.
func ForEachDriver(t *testing.T, variants []string, f func(t *testing.T, d Driver, variant string)) {
	t.Helper()
	forEach(t, DriverNames, variants, f)
}

func forEach(t *testing.T, names, variants []string, f func(t *testing.T, d Driver, variant string)) {
	t.Helper()
	for _, name := range names {
		if len(variants) == 0 {
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				f(t, DriverNamed(t, name), "")
			})
			continue
		}
		for _, variant := range variants {
			if name == MariaDB && variant == "partitioned" {
				continue // PostgreSQL only (ForEachEngine)
			}
			t.Run(name+"/"+variant, func(t *testing.T) {
				t.Parallel()
				f(t, DriverNamed(t, name), variant)
			})
		}
	}
}

// EachDriver runs f once per driver (ForEachDriver, subtests named after
// the driver), each with its own Bundle.
func EachDriver(t *testing.T, f func(t *testing.T, b *Bundle)) {
	t.Helper()
	ForEachDriver(t, nil, func(t *testing.T, d Driver, _ string) {
		f(t, NewBundle(t, d))
	})
}

// Table returns the quoted name of table in the bundle's schema (a
// business table a test creates next to the library's).
func (b *Bundle) Table(name string) string {
	return b.DB.Dialect.QuoteIdentifier(b.DB.Schema, name)
}

// MySQL is true for a bundle on MySQL/MariaDB: a test that runs SQL of its
// own picks that dialect's text.
func (b *Bundle) MySQL() bool { return b.DB.Dialect == sqlschema.MySQL }

// SQL returns pg or mysql: the text of a test's own statement in the
// bundle's dialect.
func (b *Bundle) SQL(pg, mysql string) string {
	if b.MySQL() {
		return mysql
	}
	return pg
}

// Begin starts a transaction that is rolled back at cleanup if the test did
// not end it (so that a failing test does not keep a connection busy).
func (b *Bundle) Begin(t testing.TB) wsql.Tx {
	t.Helper()
	tx, err := b.Driver.DB.BeginTx(b.Ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

// Exec runs a statement outside any transaction and returns the number of
// rows it affected.
func (b *Bundle) Exec(t testing.TB, query string, args ...any) int64 {
	t.Helper()
	res, err := b.Driver.DB.ExecContext(b.Ctx, query, args...)
	require.NoError(t, err, query)
	n, err := res.RowsAffected()
	require.NoError(t, err)
	return n
}

// Count runs a `SELECT count(*) ...` query through the bundle's driver.
func (b *Bundle) Count(t testing.TB, query string, args ...any) int64 {
	t.Helper()
	return Count(t, b.Driver.DB, query, args...)
}

// Count runs a `SELECT count(*) ...` (or any one-integer) query on db and
// returns the result; the query is bounded by BundleTimeout.
func Count(t testing.TB, db wsql.ContextExecutor, query string, args ...any) int64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), BundleTimeout)
	defer cancel()
	var n int64
	require.NoError(t, seam.QueryRow(ctx, db, query, args, &n), query)
	return n
}

// QueryRow runs a query in the handler's transaction, whichever driver the
// middleware uses, and scans its one row into dest: Exec's counterpart for
// reads.
func QueryRow(ctx context.Context, query string, args []any, dest ...any) error {
	if tx, err := exactlyonce.PgxTxFromContext(ctx); err == nil {
		return tx.QueryRow(ctx, query, args...).Scan(dest...)
	}
	tx, err := exactlyonce.StdTxFromContext(ctx)
	if err != nil {
		return err
	}
	return tx.QueryRowContext(ctx, query, args...).Scan(dest...)
}

// EventKind names what happened to a delivery, one word per Counters field:
// processed, duplicate, parked, fail_open, and for a nack its cause as
// Counters splits it (rejected, db_unavailable, claim_failed, busy, or
// failed); unknown for an event without an outcome. For reports that
// count events by kind (the chaos suite's).
func EventKind(e exactlyonce.Event) string {
	switch e.Outcome {
	case exactlyonce.Processed:
		return "processed"
	case exactlyonce.Duplicate:
		return "duplicate"
	case exactlyonce.Parked:
		return "parked"
	case exactlyonce.FailOpen:
		return "fail_open"
	case exactlyonce.Nacked:
		switch {
		case errors.Is(e.Err, exactlyonce.ErrInvalidKey):
			return "rejected"
		case errors.Is(e.Err, exactlyonce.ErrDBUnavailable) && !errors.Is(e.Err, exactlyonce.ErrLeaseLost) && e.Attempt == 0:
			return "db_unavailable"
		case errors.Is(e.Err, exactlyonce.ErrClaimFailed):
			return "claim_failed"
		case errors.Is(e.Err, exactlyonce.ErrLeaseHeld):
			return "busy"
		}
		return "failed"
	}
	return "unknown"
}

// Migration is one migration of the library's schema, as sqlschema.SQL
// lists it: its name (<target>_<version>_<what>.up.sql), its target table
// ("inbox" or "outbox"), its version within the target, and its SQL text.
type Migration struct {
	Name    string
	Target  string
	Version int
	SQL     string
}

// migrationHeader is the comment sqlschema.SQL puts before each migration.
var migrationHeader = regexp.MustCompile(`(?m)^-- (\S+) \(target (\w+), version (\d+)\)\n`)

// Migrations returns the migrations of db's names, in the order Migrate
// applies them, read from sqlschema.SQL (the unexported list is not
// reachable outside package sqlschema).
func Migrations(t testing.TB, db sqlschema.DB) []Migration {
	t.Helper()
	script, err := sqlschema.SQL(db)
	require.NoError(t, err)
	heads := migrationHeader.FindAllStringSubmatchIndex(script, -1)
	require.NotEmpty(t, heads, "sqlschema.SQL lists no migration")
	out := make([]Migration, 0, len(heads))
	for i, h := range heads {
		end := len(script)
		if i+1 < len(heads) {
			// SQL separates migrations with one newline before the header.
			end = heads[i+1][0] - 1
		}
		version, err := strconv.Atoi(script[h[6]:h[7]])
		require.NoError(t, err)
		out = append(out, Migration{
			Name:    script[h[2]:h[3]],
			Target:  script[h[4]:h[5]],
			Version: version,
			SQL:     script[h[1]:end],
		})
	}
	return out
}
