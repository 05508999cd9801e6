package sqlschema_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// requireStatusLists asserts that st lists exactly the migrations of the
// script of sqlschema.SQL(db), in its order, for db's table names.
func requireStatusLists(t *testing.T, st []sqlschema.MigrationStatus, db sqlschema.DB) {
	t.Helper()
	db = db.WithDefaults()
	migs := scriptMigrations(t, db)
	require.Len(t, st, len(migs))
	for i, m := range migs {
		require.Equal(t, m.Target, st[i].Target, "entry %d", i)
		require.Equal(t, m.Version, st[i].Version, "entry %d", i)
		require.Equal(t, m.Name, st[i].Name, "entry %d", i)
		table := db.OutboxTable
		if m.Target == "inbox" {
			table = db.InboxTable
		}
		require.Equal(t, table, st[i].Table, "entry %d", i)
	}
}

// Before Migrate (no schema; a schema without the migrations table) every
// migration is listed as not applied, and Status creates nothing; after it,
// every one is applied, with the time it was.
func TestStatusBeforeAndAfterMigrate(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		ctx := ctxT(t)
		db := sqlschema.DB{Conn: d.DB, Schema: freshSchema(t, d.DB)}

		st, err := sqlschema.Status(ctx, db)
		require.NoError(t, err)
		requireStatusLists(t, st, db)
		for _, m := range st {
			require.False(t, m.Applied, m.Name)
			require.Nil(t, m.AppliedAt, m.Name)
		}
		require.False(t, schemaExists(t, d.DB, db.Schema), "Status creates nothing")

		_, err = d.DB.ExecContext(ctx, "CREATE SCHEMA "+pgx.Identifier{db.Schema}.Sanitize())
		require.NoError(t, err)
		st, err = sqlschema.Status(ctx, db)
		require.NoError(t, err)
		requireStatusLists(t, st, db)
		for _, m := range st {
			require.False(t, m.Applied, m.Name)
		}
		require.False(t, tableExists(t, d.DB, db.Schema, migrationsTable), "Status creates nothing")

		before := time.Now()
		require.NoError(t, sqlschema.Migrate(ctx, db))
		st, err = sqlschema.Status(ctx, db)
		require.NoError(t, err)
		requireStatusLists(t, st, db)
		for _, m := range st {
			require.True(t, m.Applied, m.Name)
			require.NotNil(t, m.AppliedAt, m.Name)
			require.WithinDuration(t, before, *m.AppliedAt, time.Minute, m.Name)
		}
	})
}

// A migration whose row is missing from the migrations table is listed as
// not applied, and only it; tables of other names in the same schema have
// version lines of their own.
func TestStatusPerMigrationAndTable(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		ctx := ctxT(t)
		db := testenv.WithConn(testenv.Schema(t), d.DB)
		migs := scriptMigrations(t, db)
		missing := migs[len(migs)-1]
		_, err := d.DB.ExecContext(ctx, "DELETE FROM "+pgx.Identifier{db.Schema, migrationsTable}.Sanitize()+" WHERE name = $1", missing.Name)
		require.NoError(t, err)

		st, err := sqlschema.Status(ctx, db)
		require.NoError(t, err)
		requireStatusLists(t, st, db)
		for _, m := range st {
			require.Equal(t, m.Name != missing.Name, m.Applied, m.Name)
		}

		other := db
		other.InboxTable, other.OutboxTable = "other_in", "other_out"
		st, err = sqlschema.Status(ctx, other)
		require.NoError(t, err)
		requireStatusLists(t, st, other)
		for _, m := range st {
			require.False(t, m.Applied, "%s of %s", m.Name, m.Table)
		}
	})
}

// Without Conn, or with a name that is not an identifier: an error naming
// the problem, before any query.
func TestStatusBadDB(t *testing.T) {
	t.Parallel()
	_, err := sqlschema.Status(ctxT(t), sqlschema.DB{})
	require.ErrorContains(t, err, "DB.Conn is nil")

	_, err = sqlschema.Status(ctxT(t), sqlschema.DB{Conn: testenv.Drivers(t)[0].DB, Schema: "x; DROP"})
	require.ErrorContains(t, err, "DB.Schema")
}
