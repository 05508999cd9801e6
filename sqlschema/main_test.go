package sqlschema_test

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// eachDriver runs f once per driver of testenv.Drivers, as parallel
// subtests. The connections are opened inside the subtest, so subtests
// waiting for their turn hold none.
func eachDriver(t *testing.T, f func(t *testing.T, d testenv.Driver)) {
	t.Helper()
	for i, name := range []string{"pgxpool", "database-sql"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			d := testenv.Drivers(t)[i]
			require.Equal(t, name, d.Name)
			f(t, d)
		})
	}
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
		if _, err := db.ExecContext(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{name}.Sanitize()+" CASCADE"); err != nil {
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
		"SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename = $2",
		[]any{schema, table}, &n))
	return n == 1
}

func schemaExists(t *testing.T, db wsql.ContextExecutor, schema string) bool {
	t.Helper()
	var n int
	require.NoError(t, seam.QueryRow(context.Background(), db,
		"SELECT count(*) FROM pg_namespace WHERE nspname = $1", []any{schema}, &n))
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
