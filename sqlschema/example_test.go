package sqlschema_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
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
	script, err := sqlschema.SQL(sqlschema.Config{Schema: "billing", InboxTable: "inbox", OutboxTable: "outbox"})
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
	// CREATE TABLE IF NOT EXISTS "billing"."outbox" (
	// CREATE SEQUENCE IF NOT EXISTS "billing"."outbox_accepted" AS bigint CACHE 1;
}

func ExampleConfig_Validate() {
	err := sqlschema.Config{InboxTable: `x"; DROP TABLE y; --`}.Validate()
	fmt.Println(err)
	// Output:
	// sqlschema: Config.InboxTable: "x\"; DROP TABLE y; --" must match ^[A-Za-z_][A-Za-z0-9_]*$: invalid SQL identifier
}

// Migrate at start-up: it is idempotent and safe when several instances run
// it at once.
func ExampleMigrate() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.DatabaseURL())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	db := wsql.BeginnerFromPgx(pool)

	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	cfg := sqlschema.Config{Schema: "example_migrate_" + hex.EncodeToString(suffix), InboxTable: "inbox", OutboxTable: "outbox"}
	defer func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
	}()

	for range 2 { // the second run finds nothing to do
		if err := sqlschema.Migrate(ctx, db, cfg); err != nil {
			fmt.Println(err)
			return
		}
	}

	rows, err := pool.Query(ctx, "SELECT target, version, name FROM "+
		pgx.Identifier{cfg.Schema, sqlschema.MigrationsTable}.Sanitize()+" ORDER BY target, version")
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
	// inbox:inbox 1 inbox_001_create.up.sql
	// inbox:inbox 2 inbox_002_lease.up.sql
	// inbox:inbox 3 inbox_003_fencing_retention.up.sql
	// outbox:outbox 1 outbox_001_create.up.sql
	// outbox:outbox 2 outbox_002_quarantine.up.sql
	// outbox:outbox 3 outbox_003_failure_accounting.up.sql
}
