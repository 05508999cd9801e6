package sqlschema

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlfile"
)

// ErrNotMigrated means the library's tables are missing or older than this
// version of the library: run Migrate with the same DB (schema and table
// names), or apply SQL with your migration tool. It is a configuration
// error, not an outage: the middleware and the relay report it as such,
// never as an unavailable database.
var ErrNotMigrated = pgerr.ErrNotMigrated

// Check reports whether Migrate has brought db's tables up to this version
// of the library. It returns an error wrapping ErrNotMigrated that names the
// schema, the tables and the missing migrations, or the database's error
// when it cannot tell. Use it at start-up when another process owns the
// migrations. db.Conn is required.
func Check(ctx context.Context, db DB) error {
	if err := db.validateConn(); err != nil {
		return fmt.Errorf("sqlschema: Check: %w", err)
	}
	migs, err := migrations(db)
	if err != nil {
		return err
	}
	db = db.WithDefaults()
	st, err := db.bookkeeping()
	if err != nil {
		return err
	}
	if db.Dialect == MySQL {
		if err := db.checkConn(ctx); err != nil {
			return fmt.Errorf("sqlschema: Check: %w", err)
		}
	}
	exists, err := tableExists(ctx, st, db, migrationsTable)
	if err != nil {
		return fmt.Errorf("sqlschema: Check: %w", err)
	}
	if !exists {
		return pgerr.NotMigrated(db.names(), "no migrations table "+db.migrations())
	}
	applied, err := appliedMigrations(ctx, db.Conn, st, db, migs)
	if err != nil {
		return fmt.Errorf("sqlschema: Check: %w", err)
	}
	var missing []string
	for _, m := range migs {
		if _, ok := applied[db.targetName(m.Target)+":"+strconv.Itoa(m.Version)]; !ok {
			missing = append(missing, m.Name)
		}
	}
	if len(missing) > 0 {
		return pgerr.NotMigrated(db.names(), fmt.Sprintf("missing %v", missing))
	}
	return checkLayout(ctx, db.Conn, st, db)
}

// errLayout is wrapped by Check and Migrate when the inbox table's layout
// (partitioned or not) is not the one DB.Partitions states.
var errLayout = errors.New("the inbox table's layout does not match DB.Partitions")

// checkLayout reports whether the inbox table is partitioned exactly when
// db.Partitions says so. Every process must agree: a claim written for one
// layout is refused by a table of the other (docs/retention.md says how to
// move an existing table to the partitioned layout).
func checkLayout(ctx context.Context, q wsql.ContextExecutor, st sqlfile.Statements, db DB) error {
	var kind string
	if err := seam.QueryRow(ctx, q, st.Get("TableKind"), db.tableArgs(db.InboxTable), &kind); err != nil {
		if errors.Is(err, seam.ErrNoRows) {
			return nil // no table: reported as not migrated
		}
		return fmt.Errorf("sqlschema: reading the layout of %s: %w", db.Inbox(), err)
	}
	partitioned := kind == "p"
	switch {
	case db.Dialect == MySQL && kind != "r":
		return fmt.Errorf("sqlschema: %s uses the %s engine, the library needs InnoDB (transactions, row locks): %w", db.Inbox(), kind, ErrEngine)
	case partitioned && db.Partitions == nil:
		return fmt.Errorf("sqlschema: %s is partitioned but DB.Partitions is nil: %w", db.Inbox(), errLayout)
	case !partitioned && db.Partitions != nil:
		return fmt.Errorf("sqlschema: %s is a plain table but DB.Partitions is set: %w", db.Inbox(), errLayout)
	}
	return nil
}

// names is db's names for the hints of pgerr.NotMigrated.
func (c DB) names() pgerr.Tables {
	c = c.WithDefaults()
	return pgerr.Tables{Schema: c.Schema, Inbox: c.InboxTable, Outbox: c.OutboxTable}
}

// tableArgs are the TableExists and TableKind arguments naming table of
// db's schema: its quoted name on PostgreSQL, the schema and the name on
// MySQL.
func (c DB) tableArgs(table string) []any {
	if c.Dialect == MySQL {
		return []any{c.Schema, table}
	}
	return []any{c.Dialect.QuoteIdentifier(c.Schema, table)}
}

func tableExists(ctx context.Context, st sqlfile.Statements, db DB, table string) (bool, error) {
	rows, err := db.Conn.QueryContext(ctx, st.Get("TableExists"), db.tableArgs(table)...)
	if err != nil {
		return false, err
	}
	defer func() { _ = rows.Close() }()
	var exists bool
	if rows.Next() {
		if err := rows.Scan(&exists); err != nil {
			return false, err
		}
	}
	return exists, seam.Close(rows)
}
