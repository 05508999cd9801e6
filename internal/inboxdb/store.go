package inboxdb

import (
	"errors"
	"fmt"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// MaxConsumerLength is the longest consumer name, in bytes: with the
// longest key it keeps a primary-key entry within PostgreSQL's limit.
const MaxConsumerLength = 255

// DefaultMaxKeyLength is the default limit of a message key, in bytes. It
// keeps the primary key's btree entries far below PostgreSQL's ~2.7 kB limit.
const DefaultMaxKeyLength = 1024

// Config configures a Store. The zero value is valid.
type Config struct {
	// Tables names the schema and tables. Defaults to sqlschema's defaults
	// (public.watermill_inbox).
	Tables sqlschema.DB

	// MaxKeyLength is the longest accepted message key, in bytes; longer
	// keys are rejected with ErrKeyTooLong. Consider a SHA-256 key strategy
	// for long natural keys. Defaults to 1024; at most 2048.
	MaxKeyLength int

	// LiteralClaim makes BeginClaimPgx send the claim's INSERT with the
	// consumer and key as literals, parsed and planned on every claim,
	// also on connections whose pgx exec mode is cache_statement, where it
	// would otherwise use a statement it prepares once per session. See
	// BeginClaimPgx.
	LiteralClaim bool

	// OnLiteralClaim, when set, is called once, with the error that showed
	// it, when the Store stops using its prepared claim for good: the
	// statement a connection prepared was not in the session its next
	// claim ran in, or its name was taken (a connection pooler). Not
	// called for LiteralClaim.
	OnLiteralClaim func(cause error)
}

// WithDefaults returns a copy of c with empty fields set to their defaults.
func (c Config) WithDefaults() Config {
	c.Tables = c.Tables.WithDefaults()
	if c.MaxKeyLength == 0 {
		c.MaxKeyLength = DefaultMaxKeyLength
	}
	return c
}

func (c Config) validate() error {
	if err := c.Tables.Validate(); err != nil {
		return fmt.Errorf("Config.Tables: %w", err)
	}
	if c.MaxKeyLength < 1 || c.MaxKeyLength > 2048 {
		return fmt.Errorf("Config.MaxKeyLength is %d, it must be between 1 and 2048", c.MaxKeyLength)
	}
	return nil
}

// Store reads and writes the inbox table. It holds no connection: every
// method takes the database handle or transaction to work on. A Store is
// safe for concurrent use.
type Store struct {
	cfg    Config
	table  string
	parked string          // the table of parked messages
	q      queries         // the statements, rendered for the table set
	rt     runTemplates    // the run-time templates among them
	part   *partitionState // nil: the plain layout
	prep   *preparedClaim  // the pgx fast path's prepared INSERT (plain layout)
	// mysql is the MySQL/MariaDB dialect (sqlschema.MySQL): the
	// statements of queries/mysql, and the Go steps that stand in for
	// PostgreSQL's RETURNING and data-modifying CTEs.
	mysql bool
}

// NewStore returns a Store for cfg's inbox table. The table must exist: run
// sqlschema.Migrate first.
func NewStore(cfg Config) (*Store, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	q, err := loadQueries(cfg)
	if err != nil {
		return nil, fmt.Errorf("inboxdb: %w", err)
	}
	mysql := cfg.Tables.Dialect == sqlschema.MySQL
	rt, err := newRunTemplates(q, cfg.Tables.Partitions != nil, mysql)
	if err != nil {
		return nil, fmt.Errorf("inboxdb: %w", err)
	}
	s := &Store{cfg: cfg, table: cfg.Tables.Inbox(), mysql: mysql,
		parked: cfg.Tables.Dialect.QuoteIdentifier(cfg.Tables.Schema, cfg.Tables.InboxTable+"_parked"), q: q, rt: rt}
	if p := cfg.Tables.Partitions; p != nil {
		p := p.WithDefaults()
		l := inboxpart.Layout{Schema: cfg.Tables.Schema, Table: cfg.Tables.InboxTable,
			Hourly: p.Interval == sqlschema.Hourly, Ahead: p.Ahead}
		s.part = &partitionState{layout: l, locks: lockPlan{q: q, rt: rt}}
	} else if !mysql {
		s.prep = newPreparedClaim(rt, cfg)
	}
	return s, nil
}

// Table returns the quoted, schema-qualified inbox table name.
func (s *Store) Table() string { return s.table }

// ParkedTable returns the quoted, schema-qualified name of the table of
// parked messages (the inbox table's name with "_parked").
func (s *Store) ParkedTable() string { return s.parked }

// ValidateKey reports whether consumer and key can be stored: both
// non-empty, valid UTF-8 without NUL bytes, and key at most MaxKeyLength
// bytes. Errors wrap ErrEmptyConsumer, ErrEmptyKey, ErrKeyTooLong or
// ErrInvalidKey.
func (s *Store) ValidateKey(consumer, key string) error {
	if consumer == "" {
		return ErrEmptyConsumer
	}
	if err := validText(consumer); err != nil {
		return fmt.Errorf("consumer name: %w", err)
	}
	if len(consumer) > MaxConsumerLength {
		return fmt.Errorf("%w: consumer name is %d bytes, the limit is %d", ErrInvalidKey, len(consumer), MaxConsumerLength)
	}
	if key == "" {
		return ErrEmptyKey
	}
	if len(key) > s.cfg.MaxKeyLength {
		return fmt.Errorf("%w: %d bytes, the limit is %d", ErrKeyTooLong, len(key), s.cfg.MaxKeyLength)
	}
	return validText(key)
}

func validText(s string) error {
	if err := pgtext.Check(s); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidKey, err)
	}
	return nil
}

// The statuses of a record (Record.Status). Transactional mode writes done,
// and parked for a Permanent handler error; an operator's discard of a
// parked message (without forgetting the key) writes discarded.
const (
	StatusProcessing = "processing"
	StatusDone       = "done"
	StatusFailed     = "failed"
	StatusParked     = "parked"
	StatusDiscarded  = "discarded"
)

// Settled reports whether a delivery of a key whose record has this status
// is acknowledged without running the handler, and counted as a duplicate
// (Record.Duplicates): done (processed), parked (waiting for an operator)
// and discarded (an operator discarded its message).
func Settled(status string) bool {
	return status == StatusDone || status == StatusParked || status == StatusDiscarded
}

// Record is one row of the inbox.
type Record struct {
	Consumer string
	Key      string
	Status   string
	// Attempts counts the runs of the handler that claimed the key.
	Attempts int
	// Duplicates counts the deliveries recognised as duplicates.
	Duplicates  int64
	LeaseUntil  *time.Time
	FirstSeenAt time.Time
	// ProcessedAt is when the record last finished: done, failed, parked,
	// or released by an operator. Retention (Purge) ages records by it.
	ProcessedAt *time.Time
	LastError   string
	// Interrupted is true when the key's latest attempt was cut off (lease
	// mode): its lease expired mid-attempt, or its completion failed after
	// the handler ran. Whether its effect happened is unknown.
	Interrupted bool
	// Interruptions counts the key's attempts that ended interrupted.
	Interruptions int
	// ParkedByTransaction is true for a record a transactional-mode
	// consumer parked (Park): only such a record, once released, is taken
	// over by a transactional claim.
	ParkedByTransaction bool
}

func (r *Record) scanDest() []any {
	return []any{&r.Consumer, &r.Key, &r.Status, &r.Attempts, &r.Duplicates,
		&r.LeaseUntil, &r.FirstSeenAt, &r.ProcessedAt, &r.LastError, &r.Interrupted, &r.Interruptions, &r.ParkedByTransaction}
}

func notFound(err error) bool { return errors.Is(err, errNoRows) }
