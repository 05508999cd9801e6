package outbox

import (
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// RelayConfig configures a Relay. DB.Conn and Publisher are required.
type RelayConfig struct {
	// DB is the database and the outbox table: the same sqlschema.DB as
	// the middleware's. DB.Conn is required. The relay's transactions are
	// READ COMMITTED whatever the database's default.
	DB sqlschema.DB

	// Publisher receives the messages, with each row's topic. It must return
	// only once the broker has the messages (for watermill-amqp: set
	// ConfirmDelivery). If it also implements BatchPublisher (as
	// rabbitmq.Publisher does), each batch goes out in one PublishBatch call
	// with many messages awaiting their confirms at once, and Publish is not
	// used. Required.
	Publisher message.Publisher

	// ListenConnString is a PostgreSQL connection string (URL or key=value)
	// for the relay's LISTEN connection, used by Run for wake-on-commit:
	// every transaction that writes outbox rows sends a NOTIFY (debounced
	// per Writer, and per exactly-once middleware), and a listening relay relays them when they commit
	// instead of at its next poll (milliseconds instead of PollInterval/2
	// on average; figures in docs/benchmarks.md).
	//
	// Empty (the default) listens on a connection of DB.Conn's own: taken
	// out of its pgx pool for good (the pool opens another when it needs
	// one), or, when DB.Conn is a database/sql pool on pgx's stdlib, a new
	// connection with the configuration of the pool's, outside the pool (it
	// does not count against SetMaxOpenConns). Set it when DB.Conn goes through a
	// connection pooler in transaction mode (PgBouncer), where LISTEN does
	// not hold: point it at PostgreSQL directly. Without it the relay
	// detects the pooler, logs that wake-on-commit is off, and polls.
	// While the LISTEN connection is down (database restart), the relay
	// polls and reconnects with ErrorBackoff.
	ListenConnString string

	// NoListen turns wake-on-commit off: Run only polls, every
	// PollInterval, and opens no connection of its own.
	//
	// On MySQL/MariaDB (DB.Dialect sqlschema.MySQL) there is no LISTEN:
	// ListenConnString is not used, Run logs once that it polls, and
	// Stats().Listening stays false. Writers of the same process wake it at
	// once instead (see WakeRelays; the exactly-once middleware does it
	// after its commits), unless NoListen is set; rows committed by other
	// processes are relayed at the next poll.
	NoListen bool

	// BatchSize is the most rows one transaction locks, publishes and
	// deletes. Defaults to 100.
	BatchSize int

	// Workers is the number of batches relayed concurrently by this Relay,
	// each in its own transaction. Defaults to 1.
	Workers int

	// PollInterval is the wait after a poll that found less than a full
	// batch, unless a commit wakes the relay first (see ListenConnString).
	// A full batch of which something was published is followed at once by
	// the next. With wake-on-commit it bounds the latency of the rare rows
	// whose NOTIFY was debounced away and that committed long after it
	// (see notify.go), and of every row while LISTEN is unavailable.
	// Defaults to 100ms.
	PollInterval time.Duration

	// ErrorBackoff is the first pause of a topic whose rows that never
	// failed before failed, with none of its rows published (its
	// destination, or the broker, looks down): its rows are left out of
	// the next batches while the other topics flow, for ErrorBackoff
	// doubling with each such batch in a row up to MaxErrorBackoff. It is
	// also Run's first wait after a batch the database failed, doubling
	// likewise. And it paces the retries of a failing row: after its k-th
	// failed publish a row is skipped for min(ErrorBackoff * 2^(k-1),
	// MaxErrorBackoff), while the rows behind it are relayed. Defaults to
	// 500ms.
	ErrorBackoff time.Duration

	// MaxErrorBackoff caps ErrorBackoff, for Run and for a failing row's
	// retries. Defaults to 15s.
	MaxErrorBackoff time.Duration

	// IsPermanent reports whether a publish error is the message's own: the
	// broker refused this message in a way that will repeat (see
	// exactlyonce.Permanent). Only such failures count towards MaxAttempts.
	// Defaults to recognising the errors the publisher marked with a method
	// Permanent() bool that returns true (exactlyonce.Permanent's mark,
	// anywhere in the error's chain): rabbitmq.Publisher marks a message the broker closed the channel for
	// (too large, a property it rejects) and one it cannot marshal or
	// send. A publisher that does not mark its errors (watermill-amqp's)
	// needs a predicate of yours to quarantine anything, for example
	//
	//	IsPermanent: func(err error) bool {
	//		var e *amqp091.Error
	//		return errors.As(err, &e) && e.Code == amqp091.PreconditionFailed
	//	},
	//
	// without one, no publish error quarantines a row: each is retried with
	// the row's backoff, visible in Store.Pending's Failing. Unreadable stored
	// metadata always quarantines (no retry can change it).
	IsPermanent func(err error) bool

	// MaxAttempts quarantines a row after this many permanent failures (see
	// IsPermanent). Every other failure (connection or channel lost, a
	// timeout, a nack or a full queue, an unroutable message, an unknown
	// outcome) is the broker's state, not the message's: the row is retried
	// after its backoff, for as long as it lasts, never blocks the rows
	// behind it, and is never quarantined for it. A row whose metadata
	// cannot be decoded is quarantined at once. A quarantined row is
	// skipped and logged; Store.Pending reports it and Store.RequeueFailed puts it
	// back. Defaults to 5 (a permanent failure repeats by definition; the
	// retries cover a predicate that calls an error permanent that is not
	// always, and cost nothing to the rows behind).
	MaxAttempts int

	// Logger logs failed batches (error), quarantined rows (error) and
	// missing tables (error). Defaults to watermill.NewSlogLogger(nil),
	// which writes to slog.Default(): a relay that cannot publish is never
	// silent. Pass watermill.NopLogger{} to silence it.
	Logger watermill.LoggerAdapter

	// TracerProvider receives an "exactlyonce.relay.publish" span (kind
	// producer) per message published: a child of the span that wrote the
	// row (its trace context is in the row's metadata), so the trace shows
	// the time a message waited in the outbox. The message's context holds
	// the span while the publisher has it. Defaults to
	// otel.GetTracerProvider(), a no-op until the application sets one.
	TracerProvider trace.TracerProvider
}

// The defaults of RelayConfig (see its fields).
const (
	defaultBatchSize       = 100
	defaultWorkers         = 1
	defaultPollInterval    = 100 * time.Millisecond
	defaultErrorBackoff    = 500 * time.Millisecond
	defaultMaxErrorBackoff = 15 * time.Second
	defaultMaxAttempts     = 5
)

// WithDefaults returns a copy of c with empty fields set to their defaults.
func (c RelayConfig) WithDefaults() RelayConfig {
	c.DB = c.DB.WithDefaults()
	if c.BatchSize == 0 {
		c.BatchSize = defaultBatchSize
	}
	if c.Workers == 0 {
		c.Workers = defaultWorkers
	}
	if c.PollInterval == 0 {
		c.PollInterval = defaultPollInterval
	}
	if c.ErrorBackoff == 0 {
		c.ErrorBackoff = defaultErrorBackoff
	}
	if c.MaxErrorBackoff == 0 {
		c.MaxErrorBackoff = defaultMaxErrorBackoff
	}
	if c.Logger == nil {
		c.Logger = watermill.NewSlogLogger(nil)
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = defaultMaxAttempts
	}
	if c.IsPermanent == nil {
		c.IsPermanent = marked
	}
	return c
}

func (c RelayConfig) validate() error {
	switch {
	case c.DB.Conn == nil:
		return errors.New("outbox: RelayConfig.DB.Conn is required: wsql.BeginnerFromPgx(pool) or wsql.BeginnerFromStdSQL(db)")
	case c.DB.ValidateConn() != nil:
		return fmt.Errorf("outbox: RelayConfig.DB: %w", c.DB.ValidateConn())
	case c.Publisher == nil:
		return errors.New("outbox: RelayConfig.Publisher is required")
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return fmt.Errorf("outbox: RelayConfig.BatchSize is %d, it must be between 1 and 10000", c.BatchSize)
	case c.MaxAttempts < 1:
		return fmt.Errorf("outbox: RelayConfig.MaxAttempts is %d, it must be >= 1", c.MaxAttempts)
	case c.Workers < 1:
		return fmt.Errorf("outbox: RelayConfig.Workers is %d, it must be >= 1", c.Workers)
	case c.PollInterval < 0 || c.ErrorBackoff < 0 || c.MaxErrorBackoff < c.ErrorBackoff:
		return errors.New("outbox: RelayConfig: PollInterval and ErrorBackoff must be >= 0 and MaxErrorBackoff >= ErrorBackoff")
	}
	if err := c.DB.Validate(); err != nil {
		return fmt.Errorf("outbox: RelayConfig.DB: %w", err)
	}
	return nil
}
