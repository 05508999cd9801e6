package sqlschema

import (
	"context"
	"fmt"
	"strconv"
	"time"
)

// MigrationStatus is one migration embedded in this version of the library
// and whether db has it.
type MigrationStatus struct {
	// Target is "inbox" or "outbox": the table the migration belongs to.
	Target string
	// Table is the name of that table in db (InboxTable or OutboxTable).
	Table string
	// Version counts from 1 per target.
	Version int
	// Name is the migration's file name, as the migrations table records it.
	Name string
	// Applied is true when the migrations table records the migration for
	// db's schema and table.
	Applied bool
	// AppliedAt is when Migrate applied it; nil when not applied.
	AppliedAt *time.Time
}

// Status lists every migration of this version of the library, in the
// order Migrate applies them, with whether the migrations table of db's
// schema records it for db's tables. A schema or migrations table that does
// not exist yet is not an error: every migration is then reported as not
// applied. Status reads only; Check is the yes-or-no form. Scripts applied
// with SQL and another tool record nothing here. db.Conn is required.
func Status(ctx context.Context, db DB) ([]MigrationStatus, error) {
	if err := db.validateConn(); err != nil {
		return nil, fmt.Errorf("sqlschema: Status: %w", err)
	}
	migs, err := migrations(db)
	if err != nil {
		return nil, err
	}
	db = db.WithDefaults()

	st, err := db.bookkeeping()
	if err != nil {
		return nil, err
	}
	applied := map[string]time.Time{}
	exists, err := tableExists(ctx, st, db, migrationsTable)
	if err != nil {
		return nil, fmt.Errorf("sqlschema: Status: %w", err)
	}
	if exists {
		if applied, err = appliedMigrations(ctx, db.Conn, st, db, migs); err != nil {
			return nil, fmt.Errorf("sqlschema: Status: %w", err)
		}
	}

	out := make([]MigrationStatus, 0, len(migs))
	for _, m := range migs {
		st := MigrationStatus{Target: m.Target, Table: db.OutboxTable, Version: m.Version, Name: m.Name}
		if m.Target == "inbox" {
			st.Table = db.InboxTable
		}
		if at, ok := applied[db.targetName(m.Target)+":"+strconv.Itoa(m.Version)]; ok {
			st.Applied = true
			st.AppliedAt = &at
		}
		out = append(out, st)
	}
	return out, nil
}
