package middleware

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// TopicMetadataKey, set on a message the handler returns, overrides its
// destination topic. The middleware removes it before writing the message
// to the outbox. See SetDestination.
const TopicMetadataKey = "_exactlyonce_topic"

// SetDestination sets the topic the outbox relay publishes msg to, instead
// of the handler's publish topic.
func SetDestination(msg *message.Message, topic string) {
	msg.Metadata.Set(TopicMetadataKey, topic)
}

// Errors returned to the router (wrapped). The key errors are inbox's own
// sentinels, so errors.Is works with either name.
var (
	ErrEmptyKey   = inbox.ErrEmptyKey
	ErrKeyTooLong = inbox.ErrKeyTooLong
	ErrInvalidKey = inbox.ErrInvalidKey

	// ErrDBUnavailable wraps a failure to reach the database before the
	// handler ran (begin or claim): the connection could not be made or was
	// lost, or the server is shutting down or full. The message was not
	// processed; it is nacked after NackDelay, or, with FailOpen, the
	// handler runs without deduplication. See docs/guarantees.md for the
	// exact list of errors that count.
	ErrDBUnavailable = errors.New("exactlyonce: database unavailable")

	// ErrClaimFailed wraps any other database error before the handler ran
	// (a serialization failure that kept recurring, a lock or statement
	// timeout, a missing table, a pooler's refusal). The message was not
	// processed; it is nacked after NackDelay. FailOpen never runs the
	// handler for these: the database is there, and another copy may be
	// running the key.
	ErrClaimFailed = errors.New("exactlyonce: claim failed")

	// ErrHandlerPanic wraps a recovered handler panic.
	ErrHandlerPanic = errors.New("exactlyonce: handler panicked")

	// ErrNoDestination means the handler returned messages but neither
	// the handler's publish topic, Config.PublishTopic nor SetDestination
	// gave them a topic.
	ErrNoDestination = errors.New("exactlyonce: output message has no destination topic")
)

// Mode selects how the middleware protects a handler.
type Mode int

const (
	// Transactional (the default): the inbox row, the handler's writes and
	// its output messages commit in one transaction. For handlers whose
	// effects live in the same PostgreSQL database.
	Transactional Mode = iota
	// Lease: the claim is committed before the handler runs, with a lease;
	// completion (the handler's DB writes, its output messages and the done
	// record) commits after. For handlers with effects outside the database
	// (an SMS, an e-mail, a payment). See docs/choosing-a-mode.md.
	Lease
)

// ExpiredPolicy is inbox.ExpiredPolicy: what lease mode does with a key
// whose previous attempt's lease expired mid-attempt.
type ExpiredPolicy = inbox.ExpiredPolicy

// The lease-expiry policies.
const (
	RetryExpired = inbox.RetryExpired
	ParkExpired  = inbox.ParkExpired
)

// Config configures the middleware. DB is required.
type Config struct {
	// DB begins the per-message transaction: sql.BeginnerFromPgx(pool) or
	// sql.BeginnerFromStdSQL(db) from
	// github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql. Required.
	DB wsql.Beginner

	// Mode is Transactional or Lease. Defaults to Transactional.
	Mode Mode

	// Lease is how long a lease-mode claim keeps other workers off a key
	// while the handler runs; handlers that may run longer extend it with
	// ExtendLease. After it expires, OnExpired decides. Lease mode only.
	// Defaults to 30s.
	Lease time.Duration

	// OnExpired is what lease mode does with a key found processing with
	// an expired lease: RetryExpired (run again, same idempotency key) or
	// ParkExpired (record parked and ack; an operator releases it). Lease
	// mode only. Defaults to RetryExpired.
	OnExpired ExpiredPolicy

	// MaxInterruptedAttempts bounds RetryExpired: once this many attempts of
	// a key were interrupted (their lease expired mid-attempt, or their
	// completion failed after the handler ran), the key is parked for an
	// operator instead of run again. Each interrupted attempt may have
	// performed its effect. Lease mode only. Defaults to
	// DefaultMaxInterruptedAttempts (3).
	MaxInterruptedAttempts int

	// Tables names the inbox and outbox tables. Defaults to sqlschema's
	// defaults. Create them with sqlschema.Migrate.
	Tables sqlschema.Config

	// Consumer is the name keys are recorded under. Two handlers that must
	// each process every message need different names. Defaults to the
	// router handler's name (message.HandlerNameFromCtx); a message seen
	// outside a router with no Consumer set is rejected.
	Consumer string

	// Key derives the deduplication key of a message. Defaults to
	// KeyFromUUID.
	Key KeyFunc

	// MaxKeyLength is the longest accepted key in bytes. Defaults to 1024.
	MaxKeyLength int

	// PublishTopic is the outbox destination of the messages the handler
	// returns. Defaults to the router handler's publish topic
	// (message.PublishTopicFromCtx). SetDestination overrides it per message.
	PublishTopic string

	// FailOpen, when true, runs the handler without deduplication and
	// without a transaction when the database cannot be reached before the
	// handler runs (ErrDBUnavailable: connection refused or lost, server
	// shutting down or full), and returns its messages to the router, which
	// publishes them to the handler's publish topic. Any other database
	// error (ErrClaimFailed) is a nack, never a fail-open run. Duplicates
	// become possible; each run is reported as EventFailOpen. Transactional
	// mode only: lease mode exists to keep two workers off one key, and New
	// refuses FailOpen with it. Defaults to false: fail closed (nack and
	// retry later).
	FailOpen bool

	// NackDelay is how long the middleware waits before returning the
	// error for a delivery that failed for a reason a retry at once would
	// not fix (ErrDBUnavailable, ErrClaimFailed, a rejected key, a held
	// lease, inbox.ErrNotDone, output messages the outbox refuses), so that
	// the broker does not redeliver it in a tight loop. The wait ends early when
	// the message's context ends. Handler errors are returned at once: put
	// Watermill's Retry middleware outside this one for those. Defaults to
	// 1s; a negative value disables the wait.
	NackDelay time.Duration

	// OnEvent is called after every delivery with its outcome, for metrics.
	// It must be fast and safe for concurrent use. Defaults to nothing.
	OnEvent func(Event)

	// Logger logs duplicates (debug), failures and fail-open runs.
	// Defaults to no logging.
	Logger watermill.LoggerAdapter
}

// Defaults of Config.
const (
	DefaultLease                  = 30 * time.Second
	DefaultNackDelay              = time.Second
	DefaultMaxInterruptedAttempts = 3
)

// maxClaimTries bounds the claims of one delivery that lose a race under
// REPEATABLE READ or SERIALIZABLE (see beginClaim).
const maxClaimTries = 5

// Middleware is the transactional exactly-once middleware. Create it with
// New and attach its Middleware method to a router or handler.
type Middleware struct {
	cfg    Config
	store  *inbox.Store
	scopes scopes
}

// New validates cfg and returns the middleware. It does not touch the
// database; the tables must exist before messages arrive.
func New(cfg Config) (*Middleware, error) {
	if cfg.DB == nil {
		return nil, errors.New("exactlyonce: Config.DB is required (sql.BeginnerFromPgx(pool) or sql.BeginnerFromStdSQL(db))")
	}
	cfg.Tables = cfg.Tables.WithDefaults()
	if cfg.Key == nil {
		cfg.Key = KeyFromUUID()
	}
	if cfg.OnEvent == nil {
		cfg.OnEvent = func(Event) {}
	}
	if cfg.NackDelay == 0 {
		cfg.NackDelay = DefaultNackDelay
	}
	if cfg.Lease == 0 {
		cfg.Lease = DefaultLease
	}
	if cfg.MaxInterruptedAttempts == 0 {
		cfg.MaxInterruptedAttempts = DefaultMaxInterruptedAttempts
	}
	if cfg.Mode != Transactional && cfg.Mode != Lease {
		return nil, fmt.Errorf("exactlyonce: Config.Mode is %d, want Transactional or Lease", cfg.Mode)
	}
	if cfg.Mode == Lease && cfg.FailOpen {
		return nil, errors.New("exactlyonce: Config.FailOpen cannot be used with Lease mode: running the handler without its claim would let two workers run one key at once")
	}
	if cfg.MaxInterruptedAttempts < 1 {
		return nil, fmt.Errorf("exactlyonce: Config.MaxInterruptedAttempts is %d, it must be at least 1", cfg.MaxInterruptedAttempts)
	}
	if cfg.Lease < time.Second {
		return nil, fmt.Errorf("exactlyonce: Config.Lease is %s, it must be at least 1s", cfg.Lease)
	}
	if cfg.OnExpired != RetryExpired && cfg.OnExpired != ParkExpired {
		return nil, fmt.Errorf("exactlyonce: Config.OnExpired is %d, want RetryExpired or ParkExpired", cfg.OnExpired)
	}
	if cfg.Logger == nil {
		cfg.Logger = watermill.NopLogger{}
	}
	if err := cfg.Tables.Validate(); err != nil {
		return nil, fmt.Errorf("exactlyonce: Config.Tables: %w", err)
	}
	store, err := inbox.NewStore(inbox.Config{Tables: cfg.Tables, MaxKeyLength: cfg.MaxKeyLength})
	if err != nil {
		return nil, fmt.Errorf("exactlyonce: %w", err)
	}
	return &Middleware{cfg: cfg, store: store}, nil
}

// Store returns the inbox store the middleware writes to.
func (m *Middleware) Store() *inbox.Store { return m.store }

// Middleware wraps h. It has the signature of message.HandlerMiddleware.
func (m *Middleware) Middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		start := time.Now()
		ev := Event{MessageUUID: msg.UUID}
		defer func() {
			ev.Duration = time.Since(start)
			m.cfg.OnEvent(ev)
		}()
		out, err := m.handle(msg, h, &ev)
		if err != nil {
			ev.Err = err
		}
		return out, err
	}
}

func (m *Middleware) handle(msg *message.Message, h message.HandlerFunc, ev *Event) ([]*message.Message, error) {
	origCtx := msg.Context()
	consumer := m.cfg.Consumer
	if consumer == "" {
		consumer = message.HandlerNameFromCtx(origCtx)
	}
	ev.Consumer = consumer

	key, err := m.cfg.Key(msg)
	if err == nil {
		err = m.store.ValidateKey(consumer, key)
	}
	if err != nil {
		ev.Kind = EventRejected
		// Never succeeds on redelivery: the wait keeps a consumer without a
		// poison queue from spinning on it (it still blocks that consumer).
		sleep(origCtx, m.cfg.NackDelay)
		return nil, keyError(msg, consumer, err)
	}
	ev.Key = key
	if m.cfg.Mode == Lease {
		return m.handleLease(msg, h, ev, origCtx, consumer, key)
	}

	m.scopes.check(m, msg, consumer)

	tx, claim, err := m.beginClaim(origCtx, consumer, key)
	if errors.Is(err, inbox.ErrNotDone) {
		ev.Kind = EventFailed
		sleep(origCtx, m.cfg.NackDelay) // a configuration error: never succeeds on redelivery
		return nil, fmt.Errorf("exactlyonce: %w", err)
	}
	if err != nil {
		return m.claimFailure(msg, h, ev, err)
	}
	if !claim.Claimed {
		ev.Kind = EventDuplicate
		ev.FirstSeenAt = claim.Existing.FirstSeenAt
		m.cfg.Logger.Debug("exactlyonce: duplicate message acked without running the handler", watermill.LogFields{
			"message_uuid": msg.UUID, "consumer": consumer, "key": key,
			"first_seen_at": claim.Existing.FirstSeenAt, "duplicates": claim.Existing.Duplicates,
		})
		return nil, nil
	}
	done := false
	defer func() {
		if !done {
			_ = tx.Rollback()
		}
	}()

	ob := &lazyOutbox{tx: readyTx(tx), tables: m.cfg.Tables}
	msg.SetContext(withHandlerContext(origCtx, &handlerValues{tx: ob.tx, outbox: ob, consumer: consumer, key: key}))
	produced, err := callHandler(h, msg)
	msg.SetContext(origCtx)
	if err != nil {
		ev.Kind = EventFailed
		return nil, err
	}
	outputs, err := m.prepareOutputs(msg, produced)
	if err == nil {
		err = outputs.write(ob)
	}
	if err != nil {
		ev.Kind = EventFailed
		_ = tx.Rollback()
		done = true
		if isOutputError(err) {
			// Refused before any SQL: the same on every redelivery.
			sleep(origCtx, m.cfg.NackDelay)
		}
		return nil, err
	}
	done = true
	if err := tx.Commit(); err != nil {
		ev.Kind = EventFailed
		return nil, fmt.Errorf("exactlyonce: commit of %q for %q failed, the message will be redelivered: %w", key, consumer, err)
	}
	ev.Kind = EventProcessed
	return nil, nil
}

// beginClaim begins the message's transaction and claims the key in it.
// For a duplicate it returns a nil tx (the duplicate counter is already
// committed, best-effort). A pgx pool takes the one-round-trip path.
//
// The transaction has the database's default isolation (the handler's
// writes share it). Under REPEATABLE READ or SERIALIZABLE a claim that
// waited for another transaction's claim of the same key fails with a
// serialization failure when that one commits, because the row is not in
// this transaction's snapshot. The claim is the transaction's first
// statement, so nothing is lost by rolling back and claiming again in a new
// transaction, whose snapshot sees the winner's row: the delivery is then a
// duplicate, exactly as under READ COMMITTED.
func (m *Middleware) beginClaim(ctx context.Context, consumer, key string) (wsql.Tx, inbox.ClaimResult, error) {
	for try := 1; ; try++ {
		tx, claim, err := m.beginClaimOnce(ctx, consumer, key)
		if err == nil || try == maxClaimTries || !pgerr.SerializationFailure(err) || ctx.Err() != nil {
			return tx, claim, err
		}
	}
}

func (m *Middleware) beginClaimOnce(ctx context.Context, consumer, key string) (wsql.Tx, inbox.ClaimResult, error) {
	if pool, ok := pgxPool(m.cfg.DB); ok {
		tx, claim, err := m.beginClaimPgx(ctx, pool, consumer, key)
		if tx == nil {
			return nil, claim, err
		}
		return tx, claim, err
	}
	tx, err := m.cfg.DB.BeginTx(ctx, nil)
	if err != nil {
		return nil, inbox.ClaimResult{}, fmt.Errorf("begin: %w", err)
	}
	claim, err := m.store.ClaimTx(ctx, tx, consumer, key)
	if err != nil || !claim.Claimed {
		if err == nil {
			// The key is recorded as done whether or not the counter
			// update commits, so the delivery is acked either way.
			if cerr := tx.Commit(); cerr != nil {
				m.cfg.Logger.Info("exactlyonce: duplicate counter not committed", watermill.LogFields{"err": cerr.Error(), "key": key})
			}
			return nil, claim, nil
		}
		_ = tx.Rollback()
		return nil, claim, err
	}
	return tx, claim, nil
}

func keyError(msg *message.Message, consumer string, err error) error {
	hint := ""
	if errors.Is(err, inbox.ErrEmptyKey) {
		hint = ": set a UUID on the message (for a non-Watermill AMQP producer: use a subscriber unmarshaler that takes the message_id property as the UUID; watermill-amqp's DefaultMarshaler does not) or configure Config.Key"
	}
	if errors.Is(err, inbox.ErrEmptyConsumer) {
		hint = ": set Config.Consumer, or run the handler in a Watermill router"
	}
	return fmt.Errorf("exactlyonce: message %q for handler %q cannot be deduplicated: %w%s", msg.UUID, consumer, err, hint)
}

// sleep waits d or until ctx ends.
func sleep(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
