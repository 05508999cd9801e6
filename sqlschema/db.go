package sqlschema

import (
	"errors"
	"fmt"
	"regexp"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
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
// outbox.RelayConfig, outbox.NewWriter and the operator functions
// (inbox.NewStore, outbox.NewStore), so that they cannot disagree about
// where the tables are.
//
// DB is a value: WithDefaults returns a copy and never changes the caller's
// struct. Only Conn is required where a function talks to the database; the
// names default.
type DB struct {
	// Conn reaches the database: wsql.BeginnerFromPgx(pool) for a
	// *pgxpool.Pool, or wsql.BeginnerFromStdSQL(db) for a *sql.DB, from
	// github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql (imported as wsql).
	// Required by everything that queries; SQL and outbox.NewWriter do not use it.
	Conn wsql.Beginner

	// Dialect is the database engine: Postgres (the default, also when
	// empty) or MySQL
	// (MySQL 8 or MariaDB 10.6 and later; see docs/mysql.md). Every process
	// that uses the tables states the same one.
	Dialect Dialect

	// Schema holds the inbox, outbox and migrations tables. It is created by
	// Migrate if missing. Defaults to "public" on PostgreSQL. On MySQL a
	// schema is a database: empty (the default) means the database the
	// connection is in.
	Schema string

	// InboxTable is the inbox table's name. Defaults to "watermill_inbox".
	InboxTable string

	// OutboxTable is the outbox table's name. Defaults to "watermill_outbox".
	OutboxTable string

	// Partitions, when set, selects the time-partitioned inbox layout for
	// large volumes: Migrate creates the inbox table partitioned by time
	// (daily or hourly partitions, created ahead), and retention
	// (inbox.Store.Purge) drops whole partitions instead of deleting rows.
	// PostgreSQL only: MySQL refuses it (ErrUnsupported), see docs/mysql.md.
	// Deduplication stays correct across partition boundaries; the
	// handler's transaction must then be READ COMMITTED (see
	// docs/retention.md). It must be the same in every process that uses
	// the table, and it cannot be switched on for a table created without
	// it (Check reports the mismatch). Nil (the default): one plain table.
	Partitions *Partitioning
}

// PartitionInterval is the time range of one inbox partition.
type PartitionInterval string

// The partition intervals. Bounds are aligned in UTC.
const (
	Daily  PartitionInterval = "daily"
	Hourly PartitionInterval = "hourly"
)

// Partitioning configures the time-partitioned inbox layout (DB.Partitions).
type Partitioning struct {
	// Interval is the range of one partition: Daily or Hourly. Retention
	// drops a partition once all of it is older than the purge's
	// OlderThan, so a record is kept up to OlderThan plus one interval.
	// Keep the number of partitions (retention / interval + Ahead) below
	// about 100: every claim looks a key up in each of them. Defaults to
	// Daily.
	Interval PartitionInterval

	// Ahead is how many intervals after the current one have their
	// partition created in advance (by Migrate, Purge and
	// inbox.Store.MaintainPartitions). A claim at a time with no partition
	// still succeeds (it is recorded in the newest partition), but run
	// maintenance at least every Ahead intervals. Defaults to 3.
	Ahead int
}

// defaultPartitionsAhead is Partitioning.Ahead's default.
const defaultPartitionsAhead = 3

// WithDefaults returns a copy of p with empty fields set to their defaults.
func (p Partitioning) WithDefaults() Partitioning {
	if p.Interval == "" {
		p.Interval = Daily
	}
	if p.Ahead == 0 {
		p.Ahead = defaultPartitionsAhead
	}
	return p
}

func (p Partitioning) validate() error {
	p = p.WithDefaults()
	if p.Interval != Daily && p.Interval != Hourly {
		return fmt.Errorf("sqlschema: DB.Partitions.Interval is %q, it must be sqlschema.Daily or sqlschema.Hourly", p.Interval)
	}
	if p.Ahead < 1 || p.Ahead > 1000 {
		return fmt.Errorf("sqlschema: DB.Partitions.Ahead is %d, it must be between 1 and 1000", p.Ahead)
	}
	return nil
}

// WithDefaults returns a copy of c with empty names set to their defaults.
func (c DB) WithDefaults() DB {
	if c.Schema == "" && c.Dialect != MySQL {
		c.Schema = defaultSchema
	}
	if c.InboxTable == "" {
		c.InboxTable = defaultInboxTable
	}
	if c.OutboxTable == "" {
		c.OutboxTable = defaultOutboxTable
	}
	if c.Partitions != nil {
		p := c.Partitions.WithDefaults()
		c.Partitions = &p
	}
	return c
}

// Validate reports whether every name (after defaults) is a plain SQL
// identifier: a letter or underscore followed by letters, digits or
// underscores, at most 40 bytes. The error names the offending field. It
// does not check Conn.
func (c DB) Validate() error {
	c = c.WithDefaults()
	if err := c.Dialect.validate(); err != nil {
		return err
	}
	for _, f := range []struct{ field, value string }{
		{"Schema", c.Schema},
		{"InboxTable", c.InboxTable},
		{"OutboxTable", c.OutboxTable},
	} {
		if f.value == "" && f.field == "Schema" && c.Dialect == MySQL {
			continue // the connection's database
		}
		if err := validateName(f.value); err != nil {
			return fmt.Errorf("sqlschema: DB.%s: %w", f.field, err)
		}
	}
	if c.InboxTable == c.OutboxTable {
		return fmt.Errorf("sqlschema: DB.InboxTable and DB.OutboxTable are both %q: %w", c.InboxTable, errInvalidName)
	}
	if c.OutboxTable == c.InboxTable+"_parked" {
		return fmt.Errorf("sqlschema: DB.OutboxTable %q is the name of the inbox's table of parked messages (DB.InboxTable + \"_parked\"): %w", c.OutboxTable, errInvalidName)
	}
	if c.Partitions != nil {
		if c.Dialect == MySQL {
			return fmt.Errorf("sqlschema: DB.Partitions: the time-partitioned inbox is PostgreSQL only (docs/mysql.md): %w", ErrUnsupported)
		}
		return c.Partitions.validate()
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
	return c.Dialect.QuoteIdentifier(c.Schema, c.InboxTable)
}

// Outbox returns the quoted, schema-qualified outbox table name.
func (c DB) Outbox() string {
	c = c.WithDefaults()
	return c.Dialect.QuoteIdentifier(c.Schema, c.OutboxTable)
}

// migrations returns the quoted, schema-qualified migrations table name.
func (c DB) migrations() string {
	c = c.WithDefaults()
	return c.Dialect.QuoteIdentifier(c.Schema, migrationsTable)
}
