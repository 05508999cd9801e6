package sqlschema_test

import (
	"sync"
	"testing"

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
AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::regclass AND attname = 'parked_by_transaction')
AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = $1::regclass AND attname = 'idempotency_key_format'))::text`, db.Inbox()))

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
