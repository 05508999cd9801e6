package sqlschema_test

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// requireNotMigrated asserts that err is sqlschema.ErrNotMigrated with the
// fix in its text: what to run, and for which schema and tables.
func requireNotMigrated(t *testing.T, err error, db sqlschema.DB) {
	t.Helper()
	db = db.WithDefaults()
	require.ErrorIs(t, err, sqlschema.ErrNotMigrated)
	require.ErrorContains(t, err, "run sqlschema.Migrate")
	require.ErrorContains(t, err, `Schema: "`+db.Schema+`"`, "the error names the schema")
	require.ErrorContains(t, err, `InboxTable: "`+db.InboxTable+`"`)
	require.ErrorContains(t, err, `OutboxTable: "`+db.OutboxTable+`"`)
}

// Check after Migrate: nil, through either driver.
func TestCheckAfterMigrate(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		db := testenv.WithConn(testenv.Schema(t), d.DB)
		require.NoError(t, sqlschema.Check(ctxT(t), db))

		// Custom table names are checked under their own names.
		custom := sqlschema.DB{Conn: d.DB, Schema: freshSchema(t, d.DB), InboxTable: "In_X", OutboxTable: "out_x"}
		require.NoError(t, sqlschema.Migrate(ctxT(t), custom))
		require.NoError(t, sqlschema.Check(ctxT(t), custom))
	})
}

// Check on a schema that does not exist, and on one that exists but is
// empty: ErrNotMigrated, naming the schema and saying what to run.
func TestCheckFreshSchema(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		ctx := ctxT(t)
		db := sqlschema.DB{Conn: d.DB, Schema: freshSchema(t, d.DB)}

		err := sqlschema.Check(ctx, db)
		requireNotMigrated(t, err, db)
		require.False(t, schemaExists(t, d.DB, db.Schema), "Check creates nothing")

		_, err = d.DB.ExecContext(ctx, "CREATE SCHEMA "+pgx.Identifier{db.Schema}.Sanitize())
		require.NoError(t, err)
		err = sqlschema.Check(ctx, db)
		requireNotMigrated(t, err, db)
		require.False(t, tableExists(t, d.DB, db.Schema, migrationsTable), "Check creates nothing")

		require.NoError(t, sqlschema.Migrate(ctx, db))
		require.NoError(t, sqlschema.Check(ctx, db))
	})
}

// With one migration's row deleted from the migrations table, Check names
// that migration, and only it.
func TestCheckNamesMissingMigration(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		ctx := ctxT(t)
		db := testenv.WithConn(testenv.Schema(t), d.DB)
		migs := scriptMigrations(t, db)
		table := pgx.Identifier{db.Schema, migrationsTable}.Sanitize()

		for _, missing := range []migration{migs[1], migs[len(migs)-1]} {
			res, err := d.DB.ExecContext(ctx, "DELETE FROM "+table+" WHERE name = $1", missing.Name)
			require.NoError(t, err)
			n, err := res.RowsAffected()
			require.NoError(t, err)
			require.Equal(t, int64(1), n, missing.Name)

			err = sqlschema.Check(ctx, db)
			requireNotMigrated(t, err, db)
			require.ErrorContains(t, err, missing.Name, "the error names the missing migration")
			for _, m := range migs {
				if m.Name != missing.Name {
					require.NotContains(t, err.Error(), m.Name, "only the missing migration is named")
				}
			}

			// Migrate records it again (its SQL is idempotent), and Check is
			// satisfied.
			require.NoError(t, sqlschema.Migrate(ctx, db))
			require.NoError(t, sqlschema.Check(ctx, db))
		}
	})
}

// Two table sets in one schema: the migrations of one do not satisfy Check
// for the other.
func TestCheckTableSetsAreSeparate(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		ctx := ctxT(t)
		schema := freshSchema(t, d.DB)
		a := sqlschema.DB{Conn: d.DB, Schema: schema, InboxTable: "inbox_a", OutboxTable: "outbox_a"}
		b := sqlschema.DB{Conn: d.DB, Schema: schema, InboxTable: "inbox_b", OutboxTable: "outbox_b"}
		require.NoError(t, sqlschema.Migrate(ctx, a))
		require.NoError(t, sqlschema.Check(ctx, a))

		err := sqlschema.Check(ctx, b)
		requireNotMigrated(t, err, b)
		for _, m := range scriptMigrations(t, b) {
			require.ErrorContains(t, err, m.Name, "every migration of set b is missing")
		}
	})
}

func TestCheckErrors(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	err := sqlschema.Check(ctx, sqlschema.DB{})
	require.ErrorContains(t, err, "DB.Conn is nil")
	require.NotErrorIs(t, err, sqlschema.ErrNotMigrated, "a nil Conn is not a verdict on the tables")

	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		err := sqlschema.Check(ctx, sqlschema.DB{Conn: d.DB, InboxTable: `x"; DROP TABLE y; --`})
		require.ErrorContains(t, err, "invalid SQL identifier")
		require.ErrorContains(t, err, "DB.InboxTable")
		require.NotErrorIs(t, err, sqlschema.ErrNotMigrated)

		// A database error is returned as such, not as ErrNotMigrated.
		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		err = sqlschema.Check(cancelled, testenv.WithConn(testenv.Schema(t), d.DB))
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, sqlschema.ErrNotMigrated)
		require.True(t, strings.HasPrefix(err.Error(), "sqlschema: Check: "), err.Error())
	})
}
