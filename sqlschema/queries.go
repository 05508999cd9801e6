package sqlschema

import (
	"embed"
	"fmt"

	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlfile"
)

// queryFiles are sqlschema's bookkeeping statements
// (queries/<dialect>/bookkeeping.sql), one directory per dialect.
//
//go:embed queries
var queryFiles embed.FS

// bookkeeping renders the bookkeeping statements for c's names, once per
// call of Migrate, Check, Status or SQL.
func (c DB) bookkeeping() (sqlfile.Statements, error) {
	c = c.WithDefaults()
	st, err := sqlfile.Render(queryFiles, "queries/"+c.Dialect.String(), struct {
		Schema, Migrations string
		MigrateLockKey     int64
		MigrateLockName    string
	}{c.Dialect.QuoteIdentifier(c.Schema), c.migrations(), advisoryLockKey, mysqlLockName})
	if err != nil {
		return sqlfile.Statements{}, fmt.Errorf("sqlschema: %w", err)
	}
	return st, nil
}
