package sqlschema_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// SQL prints the schema for migration tools other than Migrate (goose,
// golang-migrate, atlas...). Here only its CREATE lines are shown.
func ExampleSQL() {
	script, err := sqlschema.SQL(sqlschema.DB{Schema: "billing", InboxTable: "inbox", OutboxTable: "outbox"})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, line := range strings.Split(script, "\n") {
		if strings.HasPrefix(line, "CREATE") {
			fmt.Println(line)
		}
	}
	// Output:
	// CREATE SCHEMA IF NOT EXISTS "billing";
	// CREATE TABLE IF NOT EXISTS "billing"."inbox" (
	// CREATE INDEX IF NOT EXISTS "inbox_first_seen_brin"
	// CREATE INDEX IF NOT EXISTS "inbox_open"
	// CREATE TABLE IF NOT EXISTS "billing"."inbox_parked" (
	// CREATE INDEX IF NOT EXISTS "inbox_parked_at" ON "billing"."inbox_parked" (parked_at);
	// CREATE INDEX IF NOT EXISTS "inbox_parked_uuid" ON "billing"."inbox_parked" (message_uuid);
	// CREATE INDEX IF NOT EXISTS "inbox_parked_metadata" ON "billing"."inbox_parked" USING gin (metadata jsonb_path_ops);
	// CREATE INDEX IF NOT EXISTS "inbox_parked_consumer_at" ON "billing"."inbox_parked" (consumer, parked_at, message_key COLLATE "C");
	// CREATE TABLE IF NOT EXISTS "billing"."outbox" (
	// CREATE INDEX IF NOT EXISTS "outbox_failing" ON "billing"."outbox" (id) WHERE failures > 0 AND quarantined_at IS NULL;
	// CREATE INDEX IF NOT EXISTS "outbox_quarantined_at" ON "billing"."outbox" (quarantined_at) WHERE quarantined_at IS NOT NULL;
	// CREATE INDEX IF NOT EXISTS "outbox_quarantined_uuid" ON "billing"."outbox" (uuid) WHERE quarantined_at IS NOT NULL;
	// CREATE INDEX IF NOT EXISTS "outbox_quarantined_metadata" ON "billing"."outbox" USING gin (metadata jsonb_path_ops) WHERE quarantined_at IS NOT NULL;
	// CREATE INDEX IF NOT EXISTS "outbox_ordering_key" ON "billing"."outbox" (ordering_key, id) WHERE ordering_key IS NOT NULL;
	// CREATE INDEX IF NOT EXISTS "outbox_ordering_key_failed" ON "billing"."outbox" (ordering_key, id) WHERE ordering_key IS NOT NULL AND failures > 0;
}

func ExampleDB_Validate() {
	err := sqlschema.DB{InboxTable: `x"; DROP TABLE y; --`}.Validate()
	fmt.Println(err)
	// Output:
	// sqlschema: DB.InboxTable: "x\"; DROP TABLE y; --" must match ^[A-Za-z_][A-Za-z0-9_]*$: invalid SQL identifier
}

// Migrate at start-up: state the database and the tables once in a
// sqlschema.DB, and hand the same value to the middleware, the relay and
// the operator tools. Migrate is idempotent and safe when several instances
// run it at once; Check tells whether the tables are up to date (for a
// service that leaves the migrations to another process).
func ExampleMigrate() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.DatabaseURL())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	db := sqlschema.DB{
		Conn:        wsql.BeginnerFromPgx(pool),
		Schema:      "example_migrate_" + hex.EncodeToString(suffix),
		InboxTable:  "inbox",
		OutboxTable: "outbox",
	}
	defer func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{db.Schema}.Sanitize()+" CASCADE")
	}()

	for range 2 { // the second run finds nothing to do
		if err := sqlschema.Migrate(ctx, db); err != nil {
			fmt.Println(err)
			return
		}
	}
	fmt.Println("check:", sqlschema.Check(ctx, db))

	rows, err := pool.Query(ctx, "SELECT target, version, name FROM "+
		pgx.Identifier{db.Schema, "watermill_exactlyonce_migrations"}.Sanitize()+" ORDER BY target, version")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var target, name string
		var version int
		if err := rows.Scan(&target, &version, &name); err != nil {
			fmt.Println(err)
			return
		}
		fmt.Println(target, version, name)
	}
	// Output:
	// check: <nil>
	// inbox:inbox 1 inbox_001_create.up.sql
	// inbox:inbox 2 inbox_002_partitioned_claim_functions.up.sql
	// outbox:outbox 1 outbox_001_create.up.sql
}

// Check at start-up when another process owns the migrations: tables that
// are missing or older than the library are ErrNotMigrated, with the fix in
// the error's text.
func ExampleCheck() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.DatabaseURL())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()

	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: "example_check_" + hex.EncodeToString(suffix)}
	defer func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{db.Schema}.Sanitize()+" CASCADE")
	}()

	err = sqlschema.Check(ctx, db)
	fmt.Println("not migrated:", errors.Is(err, sqlschema.ErrNotMigrated))
	fmt.Println("says what to run:", err != nil && strings.Contains(err.Error(), "run sqlschema.Migrate"))

	if err := sqlschema.Migrate(ctx, db); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("after Migrate:", sqlschema.Check(ctx, db))
	// Output:
	// not migrated: true
	// says what to run: true
	// after Migrate: <nil>
}
