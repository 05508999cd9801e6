package inboxdb

import (
	"context"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// CheckOpen reports, right before tx's COMMIT, whether tx is still the
// transaction its claim ran in. On MySQL a deadlock (1213) rolls the whole
// transaction back but keeps the session: a handler that ignored that
// statement's error goes on in autocommit, and the COMMIT would succeed
// with the claim gone. CheckOpen then returns an error wrapping
// pgerr.ErrRolledBack (a refused commit: nothing of the transaction
// committed). On PostgreSQL it does nothing: a failed statement aborts the
// transaction, and its COMMIT reports the rollback itself.
func (s *Store) CheckOpen(ctx context.Context, tx wsql.ContextExecutor) error {
	if s.cfg.Tables.Dialect != sqlschema.MySQL {
		return nil
	}
	var n int
	if err := seam.QueryRow(ctx, tx, s.q.get("InTransaction"), nil, &n); err != nil {
		return fmt.Errorf("checking the transaction before its COMMIT: %w", err)
	}
	if n == 0 {
		return pgerr.ErrRolledBack
	}
	return nil
}
