package main

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// migrate creates the library's inbox and outbox tables and the notifier's
// own notification_log, idempotently and safely when several instances start
// at once.
func migrate(ctx context.Context, pool *pgxpool.Pool, db sqlschema.DB) error {
	if err := sqlschema.Migrate(ctx, db); err != nil {
		return err
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	// Serialise concurrent starts: CREATE TABLE IF NOT EXISTS can still
	// collide on the type catalog when two sessions run it at once.
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(hashtext('exactlyonce-notifier-migrate'))`); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+logTable(db)+` (
    notification_id text        PRIMARY KEY,
    channel         text        NOT NULL,
    recipient       text        NOT NULL,
    status          text        NOT NULL,
    attempts        integer     NOT NULL,
    message_key     text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now()
)`); err != nil {
		return fmt.Errorf("creating notification_log: %w", err)
	}
	return tx.Commit(ctx)
}

// logTable is the quoted notification_log table, in the library's schema.
func logTable(db sqlschema.DB) string {
	return pgx.Identifier{db.WithDefaults().Schema, "notification_log"}.Sanitize()
}
