package sqlschema_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// recorded returns the rows of cfg's migrations table as
// "target/version/name", in order.
func recorded(t *testing.T, db wsql.ContextExecutor, cfg sqlschema.DB) []string {
	t.Helper()
	cfg = cfg.WithDefaults()
	table := cfg.Dialect.QuoteIdentifier(cfg.Schema, migrationsTable)
	return queryStrings(t, db, "SELECT concat(target, '/', version, '/', name) FROM "+table+" ORDER BY target, version")
}

// expected returns what recorded should find once every migration of cfg
// ran: one row per target table and version of the script sqlschema.SQL
// publishes.
func expected(t *testing.T, cfgs ...sqlschema.DB) []string {
	t.Helper()
	var out []string
	for _, cfg := range cfgs {
		migs := scriptMigrations(t, cfg)
		cfg = cfg.WithDefaults()
		for _, m := range migs {
			table := cfg.InboxTable
			if m.Target == "outbox" {
				table = cfg.OutboxTable
			}
			out = append(out, fmt.Sprintf("%s:%s/%d/%s", m.Target, table, m.Version, m.Name))
		}
	}
	slices.Sort(out)
	return out
}

// The script of SQL lists every migration, inbox first, each target's
// versions counting from 1: what Migrate applies and records.
func TestSQLMigrations(t *testing.T) {
	t.Parallel()
	migs := scriptMigrations(t, sqlschema.DB{})
	seenOutbox := false
	last := map[string]int{}
	for _, m := range migs {
		require.Contains(t, []string{"inbox", "outbox"}, m.Target, m.Name)
		if m.Target == "outbox" {
			seenOutbox = true
		} else {
			require.False(t, seenOutbox, "inbox migrations come first, got %s after an outbox one", m.Name)
		}
		require.Equal(t, last[m.Target]+1, m.Version, "versions of %s increase by one from 1", m.Target)
		last[m.Target] = m.Version
		require.True(t, strings.HasPrefix(m.Name, fmt.Sprintf("%s_%03d_", m.Target, m.Version)), m.Name)
		require.True(t, strings.HasSuffix(m.Name, ".up.sql"), m.Name)
		require.NotContains(t, m.SQL, "{{", "template not rendered in %s", m.Name)
		require.NotEmpty(t, strings.TrimSpace(m.SQL), m.Name)
	}
	require.Equal(t, 2, last["inbox"], "inbox has its create and partitioned-claim-functions migrations")
	require.Equal(t, 1, last["outbox"], "outbox has its create migration")
}

func TestMigrateIsIdempotent(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, d testenv.Driver) {
		ctx := ctxT(t)
		cfg := sqlschema.DB{Conn: d.DB, Dialect: d.Dialect, Schema: freshSchema(t, d.DB)}
		require.False(t, schemaExists(t, d.DB, cfg.Schema))

		require.NoError(t, sqlschema.Migrate(ctx, cfg))
		require.True(t, tableExists(t, d.DB, cfg.Schema, defaultInboxTable))
		require.True(t, tableExists(t, d.DB, cfg.Schema, defaultOutboxTable))
		require.True(t, tableExists(t, d.DB, cfg.Schema, migrationsTable))
		want := expected(t, cfg)
		require.Equal(t, want, recorded(t, d.DB, cfg))

		// Data survives a second run: nothing is dropped or recreated.
		_, err := d.DB.ExecContext(ctx, sqlFor(d.DB, "INSERT INTO "+cfg.Inbox()+" (consumer, message_key) VALUES ('c', 'k')",
			"INSERT INTO "+cfg.Inbox()+" (consumer, message_key, first_seen_at) VALUES ('c', 'k', UTC_TIMESTAMP(6))"))
		require.NoError(t, err)
		appliedAtQuery := sqlFor(d.DB, "SELECT applied_at::text", "SELECT CAST(applied_at AS CHAR)") + " FROM " +
			cfg.Dialect.QuoteIdentifier(cfg.Schema, migrationsTable) + " ORDER BY target, version"
		appliedAt := queryStrings(t, d.DB, appliedAtQuery)

		require.NoError(t, sqlschema.Migrate(ctx, cfg))
		require.NoError(t, sqlschema.Migrate(ctx, cfg))
		require.Equal(t, want, recorded(t, d.DB, cfg), "one row per target and version after three runs")
		require.Equal(t, appliedAt, queryStrings(t, d.DB, appliedAtQuery), "later runs apply nothing")
		require.Equal(t, []string{"c/k"}, queryStrings(t, d.DB, "SELECT concat(consumer, '/', message_key) FROM "+cfg.Inbox()))
	})
}

func TestMigrateConcurrently(t *testing.T) {
	t.Parallel()
	eachEngine(t, migrateConcurrently)
}

// TestMigrateConcurrentlyUnderEveryIsolation: concurrent Migrate calls all
// succeed whatever default isolation the role or database has. Under
// repeatable read a transaction's snapshot is taken before it waits for the
// advisory lock, so without an explicit isolation level the later calls
// would not see the first one's migrations and apply them again.
func TestMigrateConcurrentlyUnderEveryIsolation(t *testing.T) {
	t.Parallel()
	for _, level := range testenv.IsolationLevels {
		t.Run(level, func(t *testing.T) {
			t.Parallel()
			for _, d := range testenv.DriversFor(t, testenv.DatabaseURLWithIsolation(t, level)) {
				t.Run(d.Name, func(t *testing.T) { migrateConcurrently(t, d) })
			}
		})
	}
}

func migrateConcurrently(t *testing.T, d testenv.Driver) {
	ctx := ctxT(t)
	cfg := sqlschema.DB{Conn: d.DB, Dialect: d.Dialect, Schema: freshSchema(t, d.DB)}

	const n = 8
	start := make(chan struct{})
	errs := make(chan error, n)
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			<-start
			errs <- sqlschema.Migrate(ctx, cfg)
		})
	}
	close(start)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatal("concurrent Migrate calls did not finish within 60s")
	}
	close(errs)
	for err := range errs {
		require.NoError(t, err, "every concurrent Migrate succeeds (the advisory lock serialises them)")
	}
	require.Equal(t, expected(t, cfg), recorded(t, d.DB, cfg))
	require.True(t, tableExists(t, d.DB, cfg.Schema, defaultInboxTable))
	require.True(t, tableExists(t, d.DB, cfg.Schema, defaultOutboxTable))
}

func TestMigrateTwoTableSetsInOneSchema(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		ctx := ctxT(t)
		schema := freshSchema(t, d.DB)
		a := sqlschema.DB{Conn: d.DB, Schema: schema, InboxTable: "inbox_a", OutboxTable: "outbox_a"}
		b := sqlschema.DB{Conn: d.DB, Schema: schema, InboxTable: "inbox_b", OutboxTable: "outbox_b"}

		require.NoError(t, sqlschema.Migrate(ctx, a))
		require.True(t, tableExists(t, d.DB, schema, "inbox_a"))
		require.True(t, tableExists(t, d.DB, schema, "outbox_a"))
		require.False(t, tableExists(t, d.DB, schema, "inbox_b"), "migrating set A must not create set B")
		require.False(t, tableExists(t, d.DB, schema, "outbox_b"))
		require.Equal(t, expected(t, a), recorded(t, d.DB, a))

		// B's versions are not considered applied because A's are.
		require.NoError(t, sqlschema.Migrate(ctx, b))
		require.True(t, tableExists(t, d.DB, schema, "inbox_b"))
		require.True(t, tableExists(t, d.DB, schema, "outbox_b"))
		require.Equal(t, expected(t, a, b), recorded(t, d.DB, b))

		// Each set has its own indexes, named after its table.
		idx := queryStrings(t, d.DB, "SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND indexname LIKE '%brin' ORDER BY 1", schema)
		require.Equal(t, []string{"inbox_a_first_seen_brin", "inbox_b_first_seen_brin"}, idx)

		require.NoError(t, sqlschema.Migrate(ctx, a))
		require.NoError(t, sqlschema.Migrate(ctx, b))
		require.Equal(t, expected(t, a, b), recorded(t, d.DB, a))
	})
}

func TestMigrateMixedCaseNames(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		ctx := ctxT(t)
		cfg := sqlschema.DB{Conn: d.DB, Schema: freshSchemaNamed(t, d.DB, testenv.Unique(t, "EO_")), InboxTable: "Inbox_T", OutboxTable: "OutBox_T"}
		require.NotEqual(t, strings.ToLower(cfg.Schema), cfg.Schema)
		require.NoError(t, sqlschema.Migrate(ctx, cfg))
		// Quoted names keep their case: unquoted SQL would have folded them.
		require.True(t, tableExists(t, d.DB, cfg.Schema, "Inbox_T"))
		require.True(t, tableExists(t, d.DB, cfg.Schema, "OutBox_T"))
		require.False(t, tableExists(t, d.DB, strings.ToLower(cfg.Schema), "inbox_t"))
		_, err := d.DB.ExecContext(ctx, "INSERT INTO "+cfg.Inbox()+" (consumer, message_key) VALUES ('c', 'k')")
		require.NoError(t, err)
	})
}

func TestMigrateErrors(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)

	t.Run("nil Conn", func(t *testing.T) {
		t.Parallel()
		err := sqlschema.Migrate(ctx, sqlschema.DB{})
		require.Error(t, err)
		require.Contains(t, err.Error(), "DB.Conn is nil")
	})

	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		schema := freshSchema(t, d.DB)

		// An invalid name is rejected before anything is sent to the database.
		err := sqlschema.Migrate(ctx, sqlschema.DB{Conn: d.DB, Schema: schema, InboxTable: `x"; DROP TABLE y; --`})
		require.ErrorContains(t, err, "invalid SQL identifier")
		require.Contains(t, err.Error(), "DB.InboxTable")
		require.False(t, schemaExists(t, d.DB, schema), "a rejected config must create nothing")

		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		require.ErrorIs(t, sqlschema.Migrate(cancelled, sqlschema.DB{Conn: d.DB, Schema: schema}), context.Canceled)
		require.False(t, schemaExists(t, d.DB, schema))

		// A failure part-way rolls everything back (one transaction): a
		// foreign table squatting the inbox name makes its index fail.
		_, err = d.DB.ExecContext(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()+
			"; CREATE TABLE "+pgx.Identifier{schema, defaultInboxTable}.Sanitize()+" (x int)")
		require.NoError(t, err)
		err = sqlschema.Migrate(ctx, sqlschema.DB{Conn: d.DB, Schema: schema})
		require.Error(t, err)
		require.Contains(t, err.Error(), "first_seen_at")
		require.False(t, tableExists(t, d.DB, schema, migrationsTable), "the failed run must record nothing")
		require.False(t, tableExists(t, d.DB, schema, defaultOutboxTable))

		_, err = d.DB.ExecContext(ctx, "DROP TABLE "+pgx.Identifier{schema, defaultInboxTable}.Sanitize())
		require.NoError(t, err)
		require.NoError(t, sqlschema.Migrate(ctx, sqlschema.DB{Conn: d.DB, Schema: schema}))
		require.True(t, tableExists(t, d.DB, schema, defaultInboxTable))
	})
}

func TestSQL(t *testing.T) {
	t.Parallel()
	cfg := sqlschema.DB{Schema: "custom_s", InboxTable: "my_inbox", OutboxTable: "my_outbox"}
	text, err := sqlschema.SQL(cfg)
	require.NoError(t, err)
	for _, want := range []string{
		`CREATE SCHEMA IF NOT EXISTS "custom_s";`,
		`CREATE TABLE IF NOT EXISTS "custom_s"."my_inbox" (`,
		`CREATE TABLE IF NOT EXISTS "custom_s"."my_outbox" (`,
		`CREATE INDEX IF NOT EXISTS "my_inbox_first_seen_brin"`,
		`ON "custom_s"."my_inbox" USING brin (first_seen_at)`,
		`PRIMARY KEY (consumer, message_key)`,
		`id              bigserial   PRIMARY KEY`,
		`CONSTRAINT "my_inbox_status_check"`,
		`CREATE TABLE IF NOT EXISTS "custom_s"."my_inbox_parked" (`,
		`CREATE INDEX IF NOT EXISTS "my_outbox_failing" ON "custom_s"."my_outbox" (id) WHERE failures > 0 AND quarantined_at IS NULL;`,
		`CREATE INDEX IF NOT EXISTS "my_outbox_quarantined_metadata" ON "custom_s"."my_outbox" USING gin (metadata jsonb_path_ops) WHERE quarantined_at IS NOT NULL;`,
	} {
		require.Contains(t, text, want)
	}
	for _, unwanted := range []string{"watermill_inbox", "watermill_outbox", "public", "{{", migrationsTable} {
		require.NotContains(t, text, unwanted)
	}
	require.Less(t, strings.Index(text, "CREATE SCHEMA"), strings.Index(text, "CREATE TABLE"), "the schema is created first")

	_, err = sqlschema.SQL(sqlschema.DB{OutboxTable: "1bad"})
	require.ErrorContains(t, err, "invalid SQL identifier")
	require.ErrorContains(t, err, "DB.OutboxTable")
	_, err = sqlschema.SQL(sqlschema.DB{Schema: "bad-name"})
	require.ErrorContains(t, err, "invalid SQL identifier")
	require.ErrorContains(t, err, "DB.Schema")

	// The script runs as is, twice, and creates the tables (but records no
	// versions: that is Migrate's job).
	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		ctx := ctxT(t)
		cfg := sqlschema.DB{Conn: d.DB, Schema: freshSchema(t, d.DB), InboxTable: "my_inbox", OutboxTable: "my_outbox"}
		text, err := sqlschema.SQL(cfg)
		require.NoError(t, err)
		for range 2 {
			_, err = d.DB.ExecContext(ctx, text)
			require.NoError(t, err)
		}
		require.True(t, tableExists(t, d.DB, cfg.Schema, "my_inbox"))
		require.True(t, tableExists(t, d.DB, cfg.Schema, "my_outbox"))
		require.False(t, tableExists(t, d.DB, cfg.Schema, migrationsTable))

		// Migrate adopts a schema created from the script.
		require.NoError(t, sqlschema.Migrate(ctx, cfg))
		require.Equal(t, expected(t, cfg), recorded(t, d.DB, cfg))
	})
}

// Tables whose migrations table records files this version does not have
// (a development build from before v0.1.0 recorded 15 migrations, of which
// the first numbers now name other files) are refused, by name, by
// Migrate, Check and Status: they do not have the shape this version
// expects, and counting them as migrated by their numbers alone left a
// service failing with "not migrated" that Migrate could not fix.
func TestMigrateRefusesTablesOfAnotherBuild(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, d testenv.Driver) {
		ctx := ctxT(t)
		cfg := sqlschema.DB{Conn: d.DB, Schema: freshSchema(t, d.DB)}
		require.NoError(t, sqlschema.Migrate(ctx, cfg))
		table := pgx.Identifier{cfg.Schema, migrationsTable}.Sanitize()
		_, err := d.DB.ExecContext(ctx, "UPDATE "+table+" SET name = 'inbox_002_lease.up.sql' WHERE target LIKE 'inbox:%' AND version = 2")
		require.NoError(t, err)
		_, err = d.DB.ExecContext(ctx, "INSERT INTO "+table+" (target, version, name) SELECT target, 3, 'inbox_003_fencing_retention.up.sql' FROM "+table+" WHERE target LIKE 'inbox:%' AND version = 1")
		require.NoError(t, err)

		for name, run := range map[string]func() error{
			"Migrate": func() error { return sqlschema.Migrate(ctx, cfg) },
			"Check":   func() error { return sqlschema.Check(ctx, cfg) },
			"Status":  func() error { _, err := sqlschema.Status(ctx, cfg); return err },
		} {
			err := run()
			require.ErrorIs(t, err, sqlschema.ErrNotMigrated, name)
			require.ErrorContains(t, err, "inbox_002_lease.up.sql, inbox_003_fencing_retention.up.sql", name)
			require.ErrorContains(t, err, "records migrations this version of the library does not have", name)
		}
		// Another table set's records in the same migrations table are not
		// this one's concern.
		other := sqlschema.DB{Conn: d.DB, Schema: cfg.Schema, InboxTable: "other_inbox", OutboxTable: "other_outbox"}
		require.NoError(t, sqlschema.Migrate(ctx, other))
		require.NoError(t, sqlschema.Check(ctx, other))
	})
}
