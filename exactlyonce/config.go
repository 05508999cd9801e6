package exactlyonce

import (
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"

	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Config configures the middleware. DB.Conn is required (except in lease
// mode with LeaseConfig.Store); every other field has a default (see
// WithDefaults).
type Config struct {
	// DB is the database and the tables: the same sqlschema.DB that
	// sqlschema.Migrate, outbox.RelayConfig and the operator functions take.
	// DB.Conn begins the message's transactions:
	// wsql.BeginnerFromPgx(pool) (the fast path: begin and claim in one
	// round trip) or wsql.BeginnerFromStdSQL(db). Required, except in lease
	// mode with a LeaseConfig.Store, where it must be left empty.
	DB sqlschema.DB

	// Lease, when set, selects lease mode: for handlers whose effect is
	// outside the database (an SMS, an e-mail, a payment). The claim
	// commits before the handler runs, with a lease; completion (the
	// handler's writes, its output messages, the done record) commits
	// after. See docs/choosing-a-mode.md. Nil (the default) is
	// transactional mode: the claim, the handler's writes and its output
	// messages commit in one transaction.
	Lease *LeaseConfig

	// Batch, when set, turns on group commit in transactional mode: the
	// deliveries in flight at the same moment share one transaction (their
	// keys claimed in one statement, their handlers run in turn, one
	// COMMIT, then every message acked). A failing handler costs only its
	// own message: the others run again without it. It needs several
	// deliveries in flight (ConcurrentSubscriber). Not with Lease or
	// FailOpen. Nil (the default): one transaction per message.
	Batch *BatchConfig

	// Consumer is the name keys are recorded under. Two handlers that must
	// each process every message need different names. Defaults to the
	// router handler's name (message.HandlerNameFromCtx); a message seen
	// outside a router with no Consumer set is rejected.
	Consumer string

	// Key derives the deduplication key of a message; an empty key is an
	// error (ErrInvalidKey), never a shared key. Defaults to the message
	// UUID. See KeyFromMetadata and KeyFromPayloadSHA256.
	Key func(msg *message.Message) (string, error)

	// MaxKeyLength is the longest accepted key in bytes, at most 2048.
	// Defaults to 1024.
	MaxKeyLength int

	// MaxParkedPayload is the largest payload, in bytes, that a parked
	// message keeps. Whenever the middleware parks a key (a Permanent
	// handler error, too many interrupted attempts, a completion that can
	// never commit), it keeps the message with the park, atomically: its
	// UUID, payload, metadata and the topic it was consumed from, with the
	// reason, attempts, and when it was first seen and parked, so that an
	// operator can find it and replay it. A larger payload is not kept,
	// only its size: the park still happens, the message is acked, and it
	// cannot be replayed (re-publish it from its source). Metadata is
	// always kept, whole up to 1 MiB of JSON (brokers keep headers far
	// smaller: RabbitMQ's fit one 128 KiB frame by default); beyond that,
	// its fields in key order while they fit, each cut to 256 bytes. A
	// UUID, topic or metadata that PostgreSQL text cannot hold (invalid
	// UTF-8, NUL) is kept with U+FFFD in place of those bytes. A message
	// whose UUID, topic or metadata had to be changed is kept without its
	// payload, so that it is never replayed as a message it was not. A
	// negative value keeps no payload. At most 64 MiB. Defaults to 1 MiB.
	MaxParkedPayload int

	// PublishTopic is the outbox destination of the messages the handler
	// returns. Defaults to the router handler's publish topic
	// (message.PublishTopicFromCtx). SetDestination overrides it per message.
	PublishTopic string

	// FailOpen, when true, runs the handler without deduplication and
	// without a transaction when the database cannot be reached before the
	// handler runs (ErrDBUnavailable: connection refused or lost, server
	// shutting down or full), and returns its messages to the router, which
	// publishes them with its own publisher (so do not give that handler
	// OutboxOnly). Any other database error (ErrClaimFailed) is a nack,
	// never a fail-open run. Duplicates become possible; each run is
	// reported as Outcome FailOpen. Transactional mode only: New refuses it
	// with Lease. Defaults to false: fail closed (nack and retry later).
	FailOpen bool

	// LiteralClaim makes the pgx fast path (DB.Conn is
	// wsql.BeginnerFromPgx(pool)) claim with an INSERT whose consumer and
	// key are literals, parsed and planned on every claim, on every
	// connection. By default a pool whose pgx exec mode is cache_statement
	// (pgx's default) claims with a statement prepared once per connection
	// (SQL-level PREPARE, about 10% less database time per claim), and any
	// other mode (exec, which docs/pgbouncer.md asks for behind PgBouncer)
	// with the literal INSERT. Set it when a pooler between the pool and
	// PostgreSQL keeps pgx's protocol-level statements but not SQL-level
	// ones (PgBouncer 1.21+ with max_prepared_statements): without it the
	// first claim that finds its statement missing is made again with the
	// literal INSERT, which the middleware then uses for good, and logs
	// once (info). Defaults to false.
	LiteralClaim bool

	// NackDelay is how long the middleware waits before returning the
	// error of a delivery that a retry at once would not fix (the database
	// unavailable or the tables not migrated, a rejected key, a held lease,
	// output messages the outbox refuses or cannot route), so that the
	// broker does not redeliver it in a tight loop. The wait ends early when
	// the message's context ends. Handler errors are returned at once: put
	// Watermill's Retry middleware outside this one for those. Defaults to
	// 1s; a negative value disables the wait.
	NackDelay time.Duration

	// OnEvent is called after every delivery with its outcome, for metrics.
	// It must be fast and safe for concurrent use. Defaults to nothing.
	OnEvent func(Event)

	// Logger logs failures (error), parked keys (error), fail-open runs
	// (error), retried interrupted attempts (info) and duplicates (debug).
	// Defaults to watermill.NewSlogLogger(nil), which writes to
	// slog.Default(). Pass watermill.NopLogger{} to silence it.
	Logger watermill.LoggerAdapter

	// TracerProvider receives the middleware's OpenTelemetry spans: one
	// "exactlyonce.process" span per delivery (kind consumer; its parent is
	// the span in the message's context, else the producer's span whose W3C
	// trace context the message carries in its metadata, which it also
	// links to), with children "exactlyonce.claim", "exactlyonce.handler"
	// (the handler's context holds it) and "exactlyonce.outbox.write". The
	// outbox rows written get the trace context of the write in their
	// metadata (traceparent, tracestate), so the next consumer links to it.
	// Defaults to otel.GetTracerProvider(), a no-op until the application
	// sets one. The library uses the OpenTelemetry API only.
	TracerProvider trace.TracerProvider
}

// LeaseConfig configures lease mode (Config.Lease).
type LeaseConfig struct {
	// Duration is how long a claim keeps other workers off a key while the
	// handler runs; a handler that may run longer extends it with
	// ExtendLease. When a lease expires with its key still processing, the
	// attempt was interrupted (the worker died or hung), and whether its
	// effect happened is unknown: the next delivery runs the key again, as
	// attempt n+1 with the same idempotency key, up to
	// MaxInterruptedAttempts. At least 1s. Defaults to 30s.
	Duration time.Duration

	// MaxInterruptedAttempts parks a key for an operator (inbox.Store
	// lists and releases parked keys) once this many of its attempts were
	// interrupted: their lease expired mid-attempt, or their completion
	// failed after the handler ran. Each may have performed its effect. 1
	// parks a key at its first interruption, for providers that cannot
	// deduplicate on the idempotency key. Defaults to 3.
	MaxInterruptedAttempts int

	// Store is where lease mode keeps its records. Nil (the default) is the
	// PostgreSQL inbox table of Config.DB, whose completion is one
	// transaction with the handler's writes and output messages. A Redis
	// store (redisstore.New) keeps them in Redis instead, for handlers
	// whose only effect is external: Config.DB must then be left empty,
	// and the handler gets no transaction and no outbox (see LeaseStore).
	Store LeaseStore
}

// LeaseStore is a lease-mode store other than the PostgreSQL inbox table:
// redisstore.New returns one. The claim, its lease and fencing token, the
// done record, the Retry and Park rules and the attempt numbers are the
// same as with PostgreSQL; what differs is the completion: it records only
// the done record, in the store, so it cannot hold database writes or
// output messages. With such a store, New refuses Config.DB, Batch,
// FailOpen and PublishTopic; a handler that asks for a transaction or an
// outbox (PgxTxFromContext, StdTxFromContext, OutboxFromContext, Exec)
// gets an error. A handler that asked for them or returned output messages
// is misconfigured, which no retry can fix: its key is parked with its
// message at once (never run again, whatever external call it made), and
// until the process restarts that handler's later keys are refused before
// it runs (nacked after NackDelay, kept until the configuration is fixed),
// as are the keys
// of a handler registered with a publish topic (router.AddHandler: use
// AddConsumerHandler). See docs/redis.md.
//
// It is sealed: only this module's stores implement it (its method is
// internal to the module, and a store has it by embedding an internal
// type), so that the contract between the middleware and its stores can
// change without breaking a program. Pass the store; there is nothing to
// call on it.
type LeaseStore interface {
	leasestore.Provider
}

// BatchConfig configures group commit (Config.Batch).
type BatchConfig struct {
	// MaxSize is the most deliveries one transaction holds, at most 1000.
	// Defaults to 64.
	MaxSize int

	// MaxWait is how long the first delivery of a batch waits for others
	// to join it before the batch runs. With 0 (the default) there is no
	// artificial wait: a batch takes the deliveries that arrived while the
	// handler's earlier batches ran (two batches of a handler run at once,
	// each running its handlers in turn).
	MaxWait time.Duration
}

// The defaults of Config, LeaseConfig and BatchConfig (see their fields).
const (
	defaultBatchMaxSize           = 64
	defaultNackDelay              = time.Second
	defaultMaxKeyLength           = 1024
	defaultMaxParkedPayload       = 1 << 20
	maxMaxParkedPayload           = 64 << 20
	defaultLeaseDuration          = 30 * time.Second
	defaultMaxInterruptedAttempts = 3
)

// WithDefaults returns a copy of c with empty fields set to their defaults,
// Lease included. It never changes the caller's struct (Lease is copied).
func (c Config) WithDefaults() Config {
	c.DB = c.DB.WithDefaults()
	if c.Key == nil {
		c.Key = keyFromUUID
	}
	if c.MaxKeyLength == 0 {
		c.MaxKeyLength = defaultMaxKeyLength
	}
	if c.MaxParkedPayload == 0 {
		c.MaxParkedPayload = defaultMaxParkedPayload
	}
	if c.NackDelay == 0 {
		c.NackDelay = defaultNackDelay
	}
	if c.OnEvent == nil {
		c.OnEvent = func(Event) {}
	}
	if c.Logger == nil {
		c.Logger = watermill.NewSlogLogger(nil)
	}
	if c.Lease != nil {
		l := c.Lease.WithDefaults()
		c.Lease = &l
	}
	if c.Batch != nil {
		b := c.Batch.WithDefaults()
		c.Batch = &b
	}
	return c
}

// WithDefaults returns a copy of c with empty fields set to their defaults.
func (c BatchConfig) WithDefaults() BatchConfig {
	if c.MaxSize == 0 {
		c.MaxSize = defaultBatchMaxSize
	}
	return c
}

// WithDefaults returns a copy of c with empty fields set to their defaults.
func (c LeaseConfig) WithDefaults() LeaseConfig {
	if c.Duration == 0 {
		c.Duration = defaultLeaseDuration
	}
	if c.MaxInterruptedAttempts == 0 {
		c.MaxInterruptedAttempts = defaultMaxInterruptedAttempts
	}
	return c
}

// storeOnly reports whether c is lease mode with a store of its own (not
// the PostgreSQL inbox of Config.DB).
func (c Config) storeOnly() bool { return c.Lease != nil && c.Lease.Store != nil }

// validateStoreOnly checks c (before its defaults) for what a lease store
// other than PostgreSQL cannot honour.
func (c Config) validateStoreOnly() error {
	const why = "the lease store (Config.Lease.Store) is not PostgreSQL"
	switch {
	case c.DB.Conn != nil || c.DB.Schema != "" || c.DB.InboxTable != "" || c.DB.OutboxTable != "":
		return errors.New("exactlyonce: Config.DB must be empty when " + why)
	case c.Batch != nil:
		return errors.New("exactlyonce: Config.Batch cannot be used with Config.Lease")
	case c.FailOpen:
		return errors.New("exactlyonce: Config.FailOpen cannot be used with Config.Lease")
	case c.PublishTopic != "":
		return errors.New("exactlyonce: Config.PublishTopic cannot be used when " + why)
	}
	return nil
}

// validate checks a Config that has its defaults. Errors name the field.
func (c Config) validate() error {
	if c.DB.Conn == nil && !c.storeOnly() {
		return errors.New("exactlyonce: Config.DB.Conn is required: wsql.BeginnerFromPgx(pool) or wsql.BeginnerFromStdSQL(db)")
	}
	if err := c.DB.Validate(); err != nil {
		return fmt.Errorf("exactlyonce: Config.DB: %w", err)
	}
	if c.DB.Conn != nil {
		if err := c.DB.ValidateConn(); err != nil {
			return fmt.Errorf("exactlyonce: Config.DB: %w", err)
		}
	}
	if c.MaxKeyLength < 1 || c.MaxKeyLength > 2048 {
		return fmt.Errorf("exactlyonce: Config.MaxKeyLength is %d, it must be between 1 and 2048", c.MaxKeyLength)
	}
	if c.MaxParkedPayload > maxMaxParkedPayload {
		return fmt.Errorf("exactlyonce: Config.MaxParkedPayload is %d, it must be at most %d (64 MiB)", c.MaxParkedPayload, maxMaxParkedPayload)
	}
	if c.Batch != nil {
		switch {
		case c.Lease != nil:
			return errors.New("exactlyonce: Config.Batch cannot be used with Config.Lease")
		case c.FailOpen:
			return errors.New("exactlyonce: Config.Batch cannot be used with Config.FailOpen")
		case c.Batch.MaxSize < 1 || c.Batch.MaxSize > 1000:
			return fmt.Errorf("exactlyonce: Config.Batch.MaxSize is %d, it must be between 1 and 1000", c.Batch.MaxSize)
		case c.Batch.MaxWait < 0:
			return fmt.Errorf("exactlyonce: Config.Batch.MaxWait is %s, it must not be negative", c.Batch.MaxWait)
		}
	}
	if c.Lease == nil {
		return nil
	}
	if c.FailOpen {
		return errors.New("exactlyonce: Config.FailOpen cannot be used with Config.Lease")
	}
	if c.Lease.Duration < time.Second {
		return fmt.Errorf("exactlyonce: Config.Lease.Duration is %s, it must be at least 1s", c.Lease.Duration)
	}
	if c.Lease.MaxInterruptedAttempts < 1 {
		return fmt.Errorf("exactlyonce: Config.Lease.MaxInterruptedAttempts is %d, it must be at least 1", c.Lease.MaxInterruptedAttempts)
	}
	return nil
}
