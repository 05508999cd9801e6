package main

import (
	"context"
	"fmt"
	"net/url"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// freshDatabase creates an empty database of the test's own (the shared
// test database holds the schemas of every other test, and the commands
// now look at all of them) and returns its URL; it is dropped at cleanup.
func freshDatabase(t *testing.T) string {
	t.Helper()
	name := testenv.Unique(t, "clidb_")
	pool := testenv.Pool(t)
	_, err := pool.Exec(testCtx(t), "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()+" TEMPLATE template0")
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := pool.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
		require.NoError(t, err)
	})
	u, err := url.Parse(testenv.DatabaseURL())
	require.NoError(t, err)
	u.Path = "/" + name
	return u.String()
}

// requireFails is requireExit with the exact error line.
func requireFails(t *testing.T, r result, code int, line string) {
	t.Helper()
	requireExit(t, r, code, line)
	require.Equal(t, "exactlyonce: "+line+"\n", r.stderr, "%s", r)
}

// The library's tables migrated in schema "shop" and the command run with
// another --schema (or other table names): it says where the tables are,
// instead of advising 'migrate up', which would create empty tables in the
// wrong place (where the commands then find nothing). Only when no schema
// holds them is 'migrate up' the advice.
func TestTablesElsewhere(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	dbURL := freshDatabase(t)
	env := []string{envDatabaseURL + "=" + dbURL}
	named := append(append([]string{}, env...), envInboxTable+"=inbox", envOutboxTable+"=outbox")

	requireFails(t, cli(t, env, "inbox", "parked", "-c", "charge-order"), exitFailed,
		`no exactly-once tables in schema "public" (inbox table "watermill_inbox", outbox table "watermill_outbox") nor in any other schema: run 'exactlyonce migrate up' with the same --schema, --inbox-table and --outbox-table`)

	requireOK(t, cli(t, named, "migrate", "up", "--schema", "shop"))

	// The wrong schema, the right table names.
	for _, args := range [][]string{
		{"inbox", "parked", "-c", "charge-order"}, {"inbox", "stats"}, {"inbox", "show", "-c", "charge-order", "k"},
		{"parked", "list"}, {"outbox", "pending"}, {"outbox", "stats"},
	} {
		requireFails(t, cli(t, named, args...), exitFailed,
			`no exactly-once tables in schema "public"; found them in schema "shop" (inbox table "inbox", outbox table "outbox"): pass --schema shop`)
	}
	// The wrong schema and table names.
	requireFails(t, cli(t, env, "inbox", "parked", "-c", "charge-order"), exitFailed,
		`no exactly-once tables in schema "public"; found them in schema "shop" (inbox table "inbox", outbox table "outbox"): pass --schema shop --inbox-table inbox --outbox-table outbox`)
	// The right schema, the wrong table names.
	requireFails(t, cli(t, env, "inbox", "parked", "--schema", "shop"), exitFailed,
		`no inbox table "watermill_inbox" nor outbox table "watermill_outbox" in schema "shop"; found inbox table "inbox", outbox table "outbox" there: pass --inbox-table inbox --outbox-table outbox`)
	requireFails(t, cli(t, env, "inbox", "stats", "--schema", "shop", "--inbox-table", "inbox"), exitFailed,
		`no outbox table "watermill_outbox" in schema "shop"; found outbox table "outbox" there: pass --outbox-table outbox`)
	requireFails(t, cli(t, env, "inbox", "stats", "--schema", "shop", "--outbox-table", "outbox"), exitFailed,
		`no inbox table "watermill_inbox" in schema "shop"; found inbox table "inbox" there: pass --inbox-table inbox`)

	// None of that created anything.
	pool := testenv.PoolFor(t, dbURL)
	var tables int
	require.NoError(t, pool.QueryRow(testCtx(t),
		`SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'public'`).Scan(&tables))
	require.Zero(t, tables, "nothing created in public")
	requireOK(t, cli(t, named, "inbox", "stats", "--schema", "shop"))

	// Several schemas hold tables: grouped by their table names, those
	// with the names asked for first.
	requireOK(t, cli(t, env, "migrate", "up", "--schema", "shop2"))
	requireOK(t, cli(t, env, "migrate", "up", "--schema", "shop3"))
	requireFails(t, cli(t, env, "inbox", "stats"), exitFailed,
		`no exactly-once tables in schema "public"; found them in schemas "shop2" and "shop3" (inbox table "watermill_inbox", outbox table "watermill_outbox") and in schema "shop" (inbox table "inbox", outbox table "outbox"): pass the service's --schema, --inbox-table and --outbox-table`)
	requireFails(t, cli(t, named, "inbox", "stats", "--schema", "nowhere"), exitFailed,
		`no exactly-once tables in schema "nowhere"; found them in schema "shop" (inbox table "inbox", outbox table "outbox") and in schemas "shop2" and "shop3" (inbox table "watermill_inbox", outbox table "watermill_outbox"): pass the service's --schema, --inbox-table and --outbox-table`)

	// Tables that are there but lack migrations: migrate up is the advice.
	_, err := pool.Exec(testCtx(t), `DELETE FROM shop2.watermill_exactlyonce_migrations WHERE name = 'outbox_001_create.up.sql'`)
	require.NoError(t, err)
	all, err := sqlschema.Status(testCtx(t), sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: "shop2"})
	require.NoError(t, err)
	requireExit(t, cli(t, env, "inbox", "stats", "--schema", "shop2"), exitFailed,
		fmt.Sprintf(`tables not migrated in schema "shop2" (inbox table "watermill_inbox", outbox table "watermill_outbox"): 1 of %d migrations missing (outbox_001_create.up.sql): run 'exactlyonce migrate up'`, len(all)))

	// A partitioned inbox is one table, not one per partition.
	requireOK(t, cli(t, env, "migrate", "up", "--schema", "big", "--partitions", "daily"))
	requireFails(t, cli(t, env, "inbox", "stats", "--schema", "big", "--partitions", "daily", "--inbox-table", "nope"), exitFailed,
		`no inbox table "nope" in schema "big"; found inbox table "watermill_inbox" there: pass --inbox-table watermill_inbox`)
}
