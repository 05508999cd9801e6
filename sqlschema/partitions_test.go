package sqlschema_test

import (
	stdsql "database/sql"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Migrate with DB.Partitions creates the inbox partitioned by partition_at,
// with the current interval's partition and Ahead more; run again (also 6
// at once) it changes nothing. Check accepts it, and reports a process
// whose DB.Partitions disagrees with the table, both ways.
func TestMigratePartitioned(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		for _, p := range []sqlschema.Partitioning{{}, {Interval: sqlschema.Hourly, Ahead: 5}} {
			db := sqlschema.DB{Conn: d.DB, Schema: freshSchema(t, d.DB), Partitions: &p}
			var wg sync.WaitGroup
			errs := make([]error, 6)
			for i := range errs {
				wg.Go(func() { errs[i] = sqlschema.Migrate(ctxT(t), db) })
			}
			wg.Wait()
			for _, err := range errs {
				require.NoError(t, err)
			}
			require.NoError(t, sqlschema.Migrate(ctxT(t), db))
			require.NoError(t, sqlschema.Check(ctxT(t), db))

			want := p.WithDefaults().Ahead + 1
			require.Equal(t, []string{"p"}, queryStrings(t, d.DB, "SELECT relkind::text FROM pg_class WHERE oid = $1::regclass", db.Inbox()))
			parts := queryStrings(t, d.DB, "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = $1::regclass ORDER BY 1", db.Inbox())
			require.Len(t, parts, want, "%+v", p)
			// Partitioned by partition_at, which has no default (a claim
			// unaware of the layout finds no partition), with every column
			// of the later migrations.
			require.Equal(t, []string{"true"}, queryStrings(t, d.DB,
				`SELECT (pg_get_partkeydef($1::regclass) = 'RANGE (partition_at)'
AND NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::regclass AND attname = 'partition_at' AND atthasdef)
AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::regclass AND attname = 'parked_by_transaction'))::text`, db.Inbox()))

			unaware := db
			unaware.Partitions = nil
			require.ErrorContains(t, sqlschema.Check(ctxT(t), unaware), "is partitioned but DB.Partitions is nil")
			require.ErrorContains(t, sqlschema.Migrate(ctxT(t), unaware), "is partitioned but DB.Partitions is nil")
		}

		plain := testenv.WithConn(testenv.Schema(t), d.DB)
		plain.Partitions = &sqlschema.Partitioning{}
		require.ErrorContains(t, sqlschema.Check(ctxT(t), plain), "is a plain table but DB.Partitions is set")
		require.ErrorContains(t, sqlschema.Migrate(ctxT(t), plain), "is a plain table but DB.Partitions is set")
	})
}

func TestPartitioningValidate(t *testing.T) {
	t.Parallel()
	for _, p := range []sqlschema.Partitioning{{Interval: "weekly"}, {Ahead: -1}, {Ahead: 1001}} {
		require.ErrorContains(t, sqlschema.DB{Partitions: &p}.Validate(), "DB.Partitions", "%+v", p)
	}
	d := sqlschema.DB{Partitions: &sqlschema.Partitioning{}}.WithDefaults()
	require.Equal(t, sqlschema.Partitioning{Interval: sqlschema.Daily, Ahead: 3}, *d.Partitions)
}

// The partitioned layout's claim functions (inbox_002), applied to a table
// that already has records in a partition of its own: Migrate records
// version 2 and creates the functions, which see those records (a key
// recorded before is a duplicate). A table renamed into place (its
// functions were created under its former name) gets them at the next
// Migrate, although version 2 is recorded for its name: Migrate creates
// them when they are missing.
func TestMigratePartitionedClaimFunctions(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		ctx := ctxT(t)
		cfg := sqlschema.DB{Conn: d.DB, Schema: freshSchema(t, d.DB), Partitions: &sqlschema.Partitioning{}}
		migs := scriptMigrations(t, cfg)
		fn := pgx.Identifier{cfg.Schema, "watermill_inbox_claim"}.Sanitize()
		// The partitioned layout's claims need READ COMMITTED (they refuse
		// any other level): asked for, not left to the database's default,
		// which a shop may set to REPEATABLE READ.
		claim := func(key string) string {
			tx, err := d.DB.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
			require.NoError(t, err)
			defer func() { _ = tx.Rollback() }()
			got := queryStrings(t, tx, "SELECT "+fn+"('c', $1, false)::text", key)
			require.NoError(t, tx.Commit())
			return got[0]
		}

		// Every migration but the claim functions, recorded as Migrate does.
		_, err := d.DB.ExecContext(ctx, `CREATE SCHEMA `+pgx.Identifier{cfg.Schema}.Sanitize()+`;
CREATE TABLE `+pgx.Identifier{cfg.Schema, migrationsTable}.Sanitize()+` (
    target text NOT NULL, version integer NOT NULL, name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (target, version))`)
		require.NoError(t, err)
		for _, m := range migs {
			if m.Target == "inbox" && m.Version >= 2 {
				continue
			}
			_, err := d.DB.ExecContext(ctx, m.SQL)
			require.NoError(t, err, m.Name)
			target := "inbox:" + defaultInboxTable
			if m.Target == "outbox" {
				target = "outbox:" + defaultOutboxTable
			}
			_, err = d.DB.ExecContext(ctx, `INSERT INTO `+pgx.Identifier{cfg.Schema, migrationsTable}.Sanitize()+
				` (target, version, name) VALUES ($1, $2, $3)`, target, m.Version, m.Name)
			require.NoError(t, err)
		}
		part := pgx.Identifier{cfg.Schema, "watermill_inbox_old"}.Sanitize()
		_, err = d.DB.ExecContext(ctx, `CREATE TABLE `+part+` (LIKE `+cfg.Inbox()+` INCLUDING DEFAULTS INCLUDING CONSTRAINTS);
ALTER TABLE `+cfg.Inbox()+` ATTACH PARTITION `+part+` FOR VALUES FROM ('2001-01-01 00:00+00') TO ('2001-01-02 00:00+00');
INSERT INTO `+cfg.Inbox()+` (consumer, message_key, partition_at) VALUES ('c', 'before', '2001-01-01 12:00+00')`)
		require.NoError(t, err)
		require.ErrorIs(t, sqlschema.Check(ctx, cfg), sqlschema.ErrNotMigrated)
		require.Equal(t, []string{"false"}, queryStrings(t, d.DB, "SELECT (to_regprocedure($1) IS NOT NULL)::text", fn+"(text, text, boolean)"))

		require.NoError(t, sqlschema.Migrate(ctx, cfg))
		require.NoError(t, sqlschema.Check(ctx, cfg))
		require.Equal(t, expected(t, cfg), recorded(t, d.DB, cfg))
		require.Equal(t, "false", claim("before"), "a key recorded before the functions, in an old partition, is a duplicate")
		require.Equal(t, "true", claim("after"))
		require.Equal(t, "false", claim("after"))
		require.Equal(t, []string{"1"}, queryStrings(t, d.DB, "SELECT count(*)::text FROM "+cfg.Inbox()+" WHERE message_key = 'after'"))

		// The functions gone (a table renamed into place): Migrate, with
		// nothing left to apply, creates them again.
		_, err = d.DB.ExecContext(ctx, "DROP FUNCTION "+fn+"(text, text, boolean)")
		require.NoError(t, err)
		require.NoError(t, sqlschema.Migrate(ctx, cfg))
		require.Equal(t, "false", claim("after"))
		require.Equal(t, expected(t, cfg), recorded(t, d.DB, cfg))
	})
}
