package pgerr

import (
	"errors"
	"fmt"
)

// ErrNotMigrated is sqlschema.ErrNotMigrated (defined here so that the
// library's packages can wrap it without importing one another).
var ErrNotMigrated = errors.New("tables not migrated")

// Tables names the schema and tables in the hint of a not-migrated error.
type Tables struct{ Schema, Inbox, Outbox string }

// NotMigrated returns an error wrapping ErrNotMigrated that says what was
// missing and what to run.
func NotMigrated(t Tables, detail string) error {
	return fmt.Errorf("%w: %s: run sqlschema.Migrate with sqlschema.DB{Schema: %q, InboxTable: %q, OutboxTable: %q}",
		ErrNotMigrated, detail, t.Schema, t.Inbox, t.Outbox)
}

// undefinedObject are the SQLSTATEs of a statement naming a table, column
// or schema the database does not have: the migrations did not run, or an
// older version of them did.
var undefinedObject = map[string]bool{
	"42P01": true, // undefined_table (also a missing sequence)
	"42703": true, // undefined_column
	"3F000": true, // invalid_schema_name
}

// Undefined reports whether err says a table, column or schema is missing:
// PostgreSQL's 42P01, 42703, 3F000; MySQL's 1146 (ER_NO_SUCH_TABLE, also a
// table in a missing database) and 1054 (ER_BAD_FIELD_ERROR).
func Undefined(err error) bool {
	if me, ok := mysqlError(err); ok {
		return mysqlUndefined[me.Number]
	}
	return undefinedObject[Code(err)]
}

// IfNotMigrated returns err with the fix appended (wrapping ErrNotMigrated)
// when it says a table, column or schema is missing, and err unchanged
// otherwise. The text keeps err first: "<err>; tables not migrated: run
// sqlschema.Migrate with ...".
func IfNotMigrated(t Tables, err error) error {
	if err == nil || errors.Is(err, ErrNotMigrated) || !Undefined(err) {
		return err
	}
	return fmt.Errorf("%w; %w", err, NotMigrated(t, "a table or column is missing"))
}
