package inboxdb_test

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// bundle is what a test of one driver works with.
type bundle struct {
	ctx    context.Context
	db     wsql.Beginner
	tables sqlschema.DB
	store  *inboxdb.Store
}

// mysql is true for a bundle on MySQL/MariaDB.
func (b bundle) mysql() bool { return b.tables.Dialect == sqlschema.MySQL }

// sql returns pg or mysql: a test's own statement in the bundle's dialect.
func (b bundle) sql(pg, mysql string) string {
	if b.mysql() {
		return mysql
	}
	return pg
}

// eachEngine is eachDriver over the engine matrix (testenv.ForEachEngine):
// PostgreSQL's drivers and layouts, and MariaDB (plain layout).
func eachEngine(t *testing.T, f func(t *testing.T, b bundle)) {
	t.Helper()
	eachEngineOf(t, testenv.Layouts, f)
}

// eachEnginePlain is eachEngine on the plain layout only.
func eachEnginePlain(t *testing.T, f func(t *testing.T, b bundle)) {
	t.Helper()
	eachEngineOf(t, []string{"plain"}, f)
}

// eachEngineOf runs f once per driver of either engine and layout
// (testenv.ForEachEngine: MariaDB gets no partitioned layout).
func eachEngineOf(t *testing.T, layouts []string, f func(t *testing.T, b bundle)) {
	t.Helper()
	testenv.ForEachEngine(t, layouts, func(t *testing.T, d testenv.Driver, layout string) {
		f(t, newBundle(t, d, layout))
	})
}

// newBundle creates the bundle of driver d and layout: a fresh migrated
// schema (a fresh database on MySQL).
func newBundle(t *testing.T, d testenv.Driver, layout string) bundle {
	t.Helper()
	var tables sqlschema.DB
	if d.Dialect == sqlschema.MySQL {
		tables = testenv.SchemaMySQL(t, d.DB)
	} else {
		tables = testenv.SchemaLayout(t, layout)
	}
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return bundle{ctx: ctx, db: d.DB, tables: tables, store: store}
}

// eachDriver runs f once per driver (testenv.ForEachDriver) and per inbox
// layout (testenv.Layouts: the plain table and the time-partitioned one),
// as parallel subtests ("pgxpool/plain", ...), each with its own migrated
// schema. Connections are opened inside the subtest, so subtests waiting
// for their turn hold none.
func eachDriver(t *testing.T, f func(t *testing.T, b bundle)) {
	t.Helper()
	eachDriverOf(t, testenv.Layouts, f)
}

// eachLayout runs f once per inbox layout (testenv.Layouts), as parallel
// subtests.
func eachLayout(t *testing.T, f func(t *testing.T, layout string)) {
	t.Helper()
	for _, layout := range testenv.Layouts {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			f(t, layout)
		})
	}
}

// eachDriverOf runs f once per driver and layout (testenv.ForEachDriver).
func eachDriverOf(t *testing.T, layouts []string, f func(t *testing.T, b bundle)) {
	t.Helper()
	testenv.ForEachDriver(t, layouts, func(t *testing.T, d testenv.Driver, layout string) {
		f(t, newBundle(t, d, layout))
	})
}

// begin starts a transaction that is rolled back at cleanup if the test did
// not end it (so that a failing test does not keep a connection busy).
func (b bundle) begin(t *testing.T) wsql.Tx {
	t.Helper()
	tx, err := b.db.BeginTx(b.ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	return tx
}

// claim claims (consumer, key) in a transaction of its own and commits it.
func (b bundle) claim(t *testing.T, consumer, key string) inboxdb.ClaimResult {
	t.Helper()
	tx := b.begin(t)
	res, err := b.store.ClaimTx(b.ctx, tx, consumer, key)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	return res
}

func (b bundle) exec(t *testing.T, q string, args ...any) int64 {
	t.Helper()
	res, err := b.db.ExecContext(b.ctx, q, args...)
	require.NoError(t, err)
	n, err := res.RowsAffected()
	require.NoError(t, err)
	return n
}

func (b bundle) count(t *testing.T, where string, args ...any) int64 {
	t.Helper()
	var n int64
	q := "SELECT COUNT(*) FROM " + b.store.Table()
	if where != "" {
		q += " WHERE " + where
	}
	require.NoError(t, seam.QueryRow(b.ctx, b.db, q, args, &n))
	return n
}

func (b bundle) strings(t *testing.T, q string, args ...any) []string {
	t.Helper()
	rows, err := b.db.QueryContext(b.ctx, q, args...)
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
