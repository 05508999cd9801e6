package sqlschema

import (
	"errors"
	"fmt"
	"regexp"

	"github.com/jackc/pgx/v5"
)

// Default names used when a Config field is empty.
const (
	DefaultSchema      = "public"
	DefaultInboxTable  = "watermill_inbox"
	DefaultOutboxTable = "watermill_outbox"

	// MigrationsTable records which migrations ran. It lives in Config.Schema.
	MigrationsTable = "watermill_exactlyonce_migrations"
)

// maxNameLength leaves room for the suffixes of index names within
// PostgreSQL's 63-byte identifier limit.
const maxNameLength = 40

var namePattern = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]*$`)

// ErrInvalidName is returned (wrapped) when a schema or table name is not a
// plain identifier.
var ErrInvalidName = errors.New("invalid SQL identifier")

// Config names the schema and tables. The zero value is valid and uses the
// defaults. Config is a value: WithDefaults returns a copy and never changes
// the caller's struct.
type Config struct {
	// Schema holds the inbox, outbox and migrations tables. It is created by
	// Migrate if missing. Defaults to "public".
	Schema string

	// InboxTable is the inbox table's name. Defaults to "watermill_inbox".
	InboxTable string

	// OutboxTable is the outbox table's name. Defaults to "watermill_outbox".
	OutboxTable string
}

// WithDefaults returns a copy of c with empty fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.Schema == "" {
		c.Schema = DefaultSchema
	}
	if c.InboxTable == "" {
		c.InboxTable = DefaultInboxTable
	}
	if c.OutboxTable == "" {
		c.OutboxTable = DefaultOutboxTable
	}
	return c
}

// Validate reports whether every name (after defaults) is a plain SQL
// identifier: a letter or underscore followed by letters, digits or
// underscores, at most 40 bytes. The error names the offending field.
func (c Config) Validate() error {
	c = c.WithDefaults()
	for _, f := range []struct{ field, value string }{
		{"Schema", c.Schema},
		{"InboxTable", c.InboxTable},
		{"OutboxTable", c.OutboxTable},
	} {
		if err := validateName(f.value); err != nil {
			return fmt.Errorf("sqlschema: Config.%s: %w", f.field, err)
		}
	}
	if c.InboxTable == c.OutboxTable {
		return fmt.Errorf("sqlschema: Config.InboxTable and Config.OutboxTable are both %q: %w", c.InboxTable, ErrInvalidName)
	}
	return nil
}

func validateName(name string) error {
	if len(name) > maxNameLength {
		return fmt.Errorf("%q is %d bytes long, the limit is %d: %w", truncate(name, 60), len(name), maxNameLength, ErrInvalidName)
	}
	if !namePattern.MatchString(name) {
		return fmt.Errorf("%q must match %s: %w", truncate(name, 60), namePattern, ErrInvalidName)
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
// used in SQL text. Call Validate first; Inbox applies the defaults itself.
func (c Config) Inbox() string {
	c = c.WithDefaults()
	return pgx.Identifier{c.Schema, c.InboxTable}.Sanitize()
}

// Outbox returns the quoted, schema-qualified outbox table name.
func (c Config) Outbox() string {
	c = c.WithDefaults()
	return pgx.Identifier{c.Schema, c.OutboxTable}.Sanitize()
}

// OutboxAcceptedSequence returns the quoted, schema-qualified name of the
// sequence the outbox relay advances once per batch of which the publisher
// accepted at least one message (migration outbox_003): "<outbox table>_accepted".
func (c Config) OutboxAcceptedSequence() string {
	return c.outboxSequence("accepted")
}

func (c Config) outboxSequence(suffix string) string {
	c = c.WithDefaults()
	return pgx.Identifier{c.Schema, c.OutboxTable + "_" + suffix}.Sanitize()
}

// migrations returns the quoted, schema-qualified migrations table name.
func (c Config) migrations() string {
	c = c.WithDefaults()
	return pgx.Identifier{c.Schema, MigrationsTable}.Sanitize()
}
