package main

import (
	"context"
	"fmt"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// migrate creates the library's inbox and outbox tables and the notifier's
// own notification_log, idempotently and safely when several instances start
// at once.
func migrate(ctx context.Context, db sqlschema.DB, st statements) error {
	if err := sqlschema.Migrate(ctx, db); err != nil {
		return err
	}
	if db.Dialect == sqlschema.MySQL {
		// DDL commits implicitly in MySQL: no transaction, and no lock
		// (see CreateLog in queries/mysql/notifier.sql).
		if _, err := db.Conn.ExecContext(ctx, st["CreateLog"]); err != nil {
			return fmt.Errorf("creating notification_log: %w", err)
		}
		return nil
	}
	tx, err := db.Conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }()
	if _, err := tx.ExecContext(ctx, st["MigrateLock"]); err != nil {
		return err
	}
	if _, err := tx.ExecContext(ctx, st["CreateLog"]); err != nil {
		return fmt.Errorf("creating notification_log: %w", err)
	}
	return tx.Commit()
}
