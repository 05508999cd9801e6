package sqlschema

import (
	"errors"
	"fmt"
	"regexp"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
)

// Default names used when a DB field is empty.
const (
	defaultSchema      = "public"
	defaultInboxTable  = "watermill_inbox"
	defaultOutboxTable = "watermill_outbox"
)

// migrationsTable records which migrations ran. It lives in DB.Schema.
const migrationsTable = "watermill_exactlyonce_migrations"

// maxNameLength leaves room for the suffixes of index names within
// PostgreSQL's 63-byte identifier limit.
const maxNameLength = 40

var namePattern = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// errInvalidName is returned (wrapped) when a schema or table name is not a
// plain identifier.
var errInvalidName = errors.New("invalid SQL identifier")

// DB is the database and the names of the library's tables in it. State it
// once and hand the same value to Migrate, to the middleware's Config, to
// outbox.RelayConfig, outbox.NewPublisher and the operator functions
// (inbox.NewStore, outbox.PendingStats), so that they cannot disagree about
// where the tables are.
//
// DB is a value: WithDefaults returns a copy and never changes the caller's
// struct. Only Conn is required where a function talks to the database; the
// names default.
type DB struct {
	// Conn reaches the database: wsql.BeginnerFromPgx(pool) for a
	// *pgxpool.Pool, or wsql.BeginnerFromStdSQL(db) for a *sql.DB, from
	// github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql (imported as wsql).
	// Required by everything that queries; SQL and NewPublisher do not use it.
	Conn wsql.Beginner

	// Schema holds the inbox, outbox and migrations tables. It is created by
	// Migrate if missing. Defaults to "public".
	Schema string

	// InboxTable is the inbox table's name. Defaults to "watermill_inbox".
	InboxTable string

	// OutboxTable is the outbox table's name. Defaults to "watermill_outbox".
	OutboxTable string
}

// WithDefaults returns a copy of c with empty names set to their defaults.
func (c DB) WithDefaults() DB {
	if c.Schema == "" {
		c.Schema = defaultSchema
	}
	if c.InboxTable == "" {
		c.InboxTable = defaultInboxTable
	}
	if c.OutboxTable == "" {
		c.OutboxTable = defaultOutboxTable
	}
	return c
}

// Validate reports whether every name (after defaults) is a plain SQL
// identifier: a letter or underscore followed by letters, digits or
// underscores, at most 40 bytes. The error names the offending field. It
// does not check Conn.
func (c DB) Validate() error {
	c = c.WithDefaults()
	for _, f := range []struct{ field, value string }{
		{"Schema", c.Schema},
		{"InboxTable", c.InboxTable},
		{"OutboxTable", c.OutboxTable},
	} {
		if err := validateName(f.value); err != nil {
			return fmt.Errorf("sqlschema: DB.%s: %w", f.field, err)
		}
	}
	if c.InboxTable == c.OutboxTable {
		return fmt.Errorf("sqlschema: DB.InboxTable and DB.OutboxTable are both %q: %w", c.InboxTable, errInvalidName)
	}
	return nil
}

func validateName(name string) error {
	if len(name) > maxNameLength {
		return fmt.Errorf("%q is %d bytes long, the limit is %d: %w", truncate(name, 60), len(name), maxNameLength, errInvalidName)
	}
	if !namePattern.MatchString(name) {
		return fmt.Errorf("%q must match %s: %w", truncate(name, 60), namePattern, errInvalidName)
	}
	return nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// Inbox returns the quoted, schema-qualified inbox table name, ready to be
// used in SQL text of your own (reports, ad-hoc queries). Call Validate
// first; Inbox applies the defaults itself.
func (c DB) Inbox() string {
	c = c.WithDefaults()
	return pgx.Identifier{c.Schema, c.InboxTable}.Sanitize()
}

// Outbox returns the quoted, schema-qualified outbox table name.
func (c DB) Outbox() string {
	c = c.WithDefaults()
	return pgx.Identifier{c.Schema, c.OutboxTable}.Sanitize()
}

func (c DB) outboxSequence(suffix string) string {
	c = c.WithDefaults()
	return pgx.Identifier{c.Schema, c.OutboxTable + "_" + suffix}.Sanitize()
}

// migrations returns the quoted, schema-qualified migrations table name.
func (c DB) migrations() string {
	c = c.WithDefaults()
	return pgx.Identifier{c.Schema, migrationsTable}.Sanitize()
}
