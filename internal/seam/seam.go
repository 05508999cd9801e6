// Package seam holds the few helpers the library needs on top of
// watermill-sql's small driver seam (sql.ContextExecutor, sql.Beginner,
// sql.Tx), which works over pgx/v5 and database/sql alike.
package seam

import (
	"context"
	"errors"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
)

// ErrNoRows is returned by QueryRow when the query returned no row.
var ErrNoRows = errors.New("no rows in result set")

// QueryRow runs a query expected to return at most one row and scans it into
// dest. It returns ErrNoRows when there is none.
func QueryRow(ctx context.Context, db wsql.ContextExecutor, query string, args []any, dest ...any) error {
	rows, err := db.QueryContext(ctx, query, args...)
	if err != nil {
		return err
	}
	if !rows.Next() {
		if err := Close(rows); err != nil {
			return err
		}
		return ErrNoRows
	}
	if err := rows.Scan(dest...); err != nil {
		_ = rows.Close()
		return err
	}
	return Close(rows)
}

// Close closes rows and returns the error met while iterating, if the driver
// reports one (both pgx.Rows and *sql.Rows do, through Err).
func Close(rows wsql.Rows) error {
	closeErr := rows.Close()
	if e, ok := rows.(interface{ Err() error }); ok {
		if err := e.Err(); err != nil {
			return err
		}
	}
	return closeErr
}

// Exec runs a statement and returns the number of rows it affected.
func Exec(ctx context.Context, db wsql.ContextExecutor, query string, args ...any) (int64, error) {
	res, err := db.ExecContext(ctx, query, args...)
	if err != nil {
		return 0, err
	}
	return res.RowsAffected()
}
