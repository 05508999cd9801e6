package inboxdb

import (
	"context"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// CheckOpen reports, right before tx's COMMIT, whether tx still holds
// what it recorded: (consumer, key) done, by its claim or a lease
// completion. On MySQL a deadlock (1213) rolls the whole transaction back
// but keeps the session: a handler that ignored that statement's error goes
// on in autocommit, and the COMMIT would succeed with the record gone.
// CheckOpen then returns an error wrapping pgerr.ErrRolledBack (a refused
// commit: nothing of the transaction committed). On PostgreSQL it does
// nothing: a failed statement aborts the transaction, and its COMMIT
// reports the rollback itself.
func (s *Store) CheckOpen(ctx context.Context, tx wsql.ContextExecutor, consumer, key string) error {
	if s.cfg.Tables.Dialect != sqlschema.MySQL {
		return nil
	}
	var n int
	if err := seam.QueryRow(ctx, tx, s.q.get("InTransaction"), []any{consumer, key}, &n); err != nil {
		return fmt.Errorf("checking the transaction before its COMMIT: %w", err)
	}
	if n == 0 {
		return pgerr.ErrRolledBack
	}
	return nil
}

// MarkTx marks tx, just begun, for CheckMark: on MySQL a savepoint; on
// PostgreSQL nothing. It is for a transaction that holds no record of the
// key until its last statements (a lease-mode handler's).
func (s *Store) MarkTx(ctx context.Context, tx wsql.ContextExecutor) error {
	if s.cfg.Tables.Dialect != sqlschema.MySQL {
		return nil
	}
	_, err := tx.ExecContext(ctx, s.q.get("MarkTx"))
	return err
}

// CheckMark is CheckOpen for a transaction MarkTx marked: the mark is gone
// when the server rolled the transaction back (pgerr.ErrRolledBack). It
// releases the mark.
func (s *Store) CheckMark(ctx context.Context, tx wsql.ContextExecutor) error {
	if s.cfg.Tables.Dialect != sqlschema.MySQL {
		return nil
	}
	if _, err := tx.ExecContext(ctx, s.q.get("CheckMark")); err != nil {
		if n, ok := pgerr.MySQLNumber(err); ok && n == 1305 { // ER_SP_DOES_NOT_EXIST
			return fmt.Errorf("%w (%w)", pgerr.ErrRolledBack, err)
		}
		return fmt.Errorf("checking the transaction before its completion: %w", err)
	}
	return nil
}
