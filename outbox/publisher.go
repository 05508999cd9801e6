package outbox

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"sync/atomic"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxrow"
	"github.com/exactlyonce/watermill-exactlyonce/internal/tracing"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// maxMessagesPerInsert keeps one INSERT well under PostgreSQL's limit of
// 65535 bind parameters (5 per message).
const maxMessagesPerInsert = 1000

// Publisher is a message.Publisher that writes messages to the outbox
// table through the transaction it is bound to. Published messages become
// visible to the Relay when that transaction commits, and vanish if it rolls
// back. Create one per transaction; it is cheap.
//
// The topic is a column of the outbox table, not a table name: any non-empty
// text (valid UTF-8 without NUL) is a topic, including "/", spaces and dots.
// watermill-sql's own publisher restricts topics to [A-Za-z0-9-$:._] because
// it makes a table per topic; that rule does not apply here. The broker may
// have rules of its own (RabbitMQ: routing keys up to 255 bytes); a row it
// refuses is quarantined by the Relay.
type Publisher struct {
	db       wsql.ContextExecutor
	adapter  schemaAdapter
	channel  string
	gate     *atomic.Int64
	notified bool // a write of this Publisher (its transaction) sent a NOTIFY
	atCommit bool // the writes send none: beforeCommit does (outboxnotify)
	wrote    bool // a write succeeded
	closed   atomic.Bool
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher that writes to db's outbox table through
// tx: wsql.TxFromPgx(tx) or wsql.TxFromStdSQL(tx) from
// github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql. db names the table; its
// Conn runs no SQL here, but tells databases apart for the wake-on-commit
// debounce: when one process writes to outbox tables of the same name in
// several databases, give each Publisher the sqlschema.DB (with Conn) its
// database's Relay has, or a write to one database can skip the NOTIFY
// that the other's Relay waits for. Any wsql.ContextExecutor works as tx.
// Given a wsql.Beginner that is not a transaction (wsql.BeginnerFromPgx(pool),
// wsql.BeginnerFromStdSQL(db)), each Publish is a transaction of its own,
// however many messages it writes, and the atomicity with your other writes
// is gone; any other executor is taken for a transaction, whose commit is
// the caller's. Inside a handler under the exactly-once middleware, use
// exactlyonce.OutboxFromContext instead.
func NewPublisher(tx wsql.ContextExecutor, db sqlschema.DB) (*Publisher, error) {
	if tx == nil {
		return nil, errors.New("outbox: NewPublisher: tx is nil")
	}
	if err := db.Validate(); err != nil {
		return nil, fmt.Errorf("outbox: NewPublisher: %w", err)
	}
	ch := channelName(db)
	return &Publisher{db: tx, adapter: schemaAdapter{table: db.Outbox()}, channel: ch, gate: notifyGate(db, ch)}, nil
}

// Publish writes messages to the outbox with topic as their destination.
// Each keeps its UUID (which must not be empty) and metadata, to which
// Publish adds the W3C trace context (traceparent, tracestate) of the
// message's context when that holds an OpenTelemetry span and the metadata
// has no traceparent yet. A message with an ordering key (SetOrderingKey)
// takes its key's lock, in the statement that writes it, for the rest of
// the transaction: another transaction writing the same key waits here
// until this one ends, so that the key's messages are relayed in the order
// their transactions committed (see docs/ordering.md). Outside a
// transaction (see NewPublisher) each Publish is one transaction of its
// own, which holds the locks until its rows are committed: one INSERT, or,
// beyond 1,000 messages (one INSERT takes at most that many), several in a
// READ COMMITTED transaction that Publish begins, commits, and rolls back
// when one fails, leaving none of the call's rows. Every message
// is checked before any is written (a non-empty topic and UUID, valid UTF-8
// without NUL in the topic, UUID and metadata: the outbox keeps messages
// byte for byte), so a bad one leaves the
// transaction as it was. The SQL runs with the first message's context.
//
// A write may also send a NOTIFY on the table's channel (debounced per
// process; see RelayConfig.ListenConnString), which PostgreSQL delivers to
// listening Relays when the transaction commits. A write that failed sent
// none and leaves the debounce as it was; once one was sent, the later
// writes of the Publisher repeat it (PostgreSQL delivers one per
// transaction), so a ROLLBACK TO SAVEPOINT that discarded it does not leave
// the transaction without one.
//
// Publish is not safe for concurrent use (neither is the transaction).
func (p *Publisher) Publish(topic string, messages ...*message.Message) error {
	if p.closed.Load() {
		return wsql.ErrPublisherClosed
	}
	// The trace context is captured now, at write time, from each
	// message's context (msg.SetContext): the consumer's span links to the
	// span that wrote the row, not to the relay.
	tracing.Inject(context.Background(), messages...)
	if err := outboxrow.Validate(topic, messages...); err != nil {
		return fmt.Errorf("outbox: Publish: %w", err)
	}
	if err := checkOrderingKeys(messages); err != nil {
		return fmt.Errorf("outbox: Publish: %w", err)
	}
	// Every INSERT of the call takes the locks of all the call's keys (a
	// lock held already is taken again at no cost).
	lock := lockHashes(messages)
	if b, ok := ownTransaction(p.db); ok && len(messages) > maxMessagesPerInsert {
		return p.publishInOwnTx(b, topic, messages, lock)
	}
	_, err := p.insert(topic, messages, lock)
	return err
}

// ownTransaction returns db as a wsql.Beginner when it is one and not a
// transaction: a Publisher bound to a pool or a *sql.DB, whose statements
// each commit on their own.
func ownTransaction(db wsql.ContextExecutor) (wsql.Beginner, bool) {
	if _, ok := db.(wsql.Tx); ok {
		return nil, false
	}
	b, ok := db.(wsql.Beginner)
	return b, ok
}

// publishInOwnTx writes messages, more than one INSERT takes, in a
// transaction of its own begun on b (READ COMMITTED, whatever the
// database's default), so that the call is one transaction, as one INSERT
// would be: all rows or none are committed, and the keys' locks are held
// until all are, so no other writer of a key commits between the INSERTs.
func (p *Publisher) publishInOwnTx(b wsql.Beginner, topic string, messages []*message.Message, lock []int32) error {
	ctx := messages[0].Context()
	tx, err := b.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("outbox: beginning the transaction of %d message(s) for topic %q: %w", len(messages), topic, err)
	}
	// The transaction's writes decide about its NOTIFY as a Publisher in
	// the caller's transaction would; a NOTIFY it sent is gone with it if
	// it does not commit.
	in := &Publisher{db: tx, adapter: p.adapter, channel: p.channel, gate: p.gate}
	undo, err := in.insert(topic, messages, lock)
	if err != nil {
		_ = tx.Rollback()
		undo()
		return err
	}
	if err := tx.Commit(); err != nil {
		undo()
		return fmt.Errorf("outbox: committing %d message(s) for topic %q: %w", len(messages), topic, err)
	}
	p.wrote = true
	return nil
}

// insert writes messages through p.db, at most maxMessagesPerInsert per
// INSERT. undo (never nil) takes back the debounce record of a NOTIFY that
// the call's writes sent, for a caller whose transaction then did not
// commit.
func (p *Publisher) insert(topic string, messages []*message.Message, lock []int32) (undo func(), err error) {
	undo = func() {}
	for len(messages) > 0 {
		n := min(len(messages), maxMessagesPerInsert)
		q, err := p.adapter.insertQuery(wsql.InsertQueryParams{Topic: topic, Msgs: messages[:n]}, lock)
		if err != nil {
			return undo, err
		}
		// Once the transaction has a NOTIFY, every INSERT of it repeats
		// it: PostgreSQL sends one per transaction and channel anyway
		// (its cost, at commit, is paid already), and a ROLLBACK TO
		// SAVEPOINT may have discarded the earlier one with its rows.
		query := q.Query
		notify, decided := p.notified, func() {}
		if !notify && !p.atCommit {
			notify, decided = shouldNotify(p.gate, time.Now())
		}
		if notify {
			query = withNotify(query, p.channel)
		}
		if _, err := p.db.ExecContext(messages[0].Context(), query, q.Args...); err != nil {
			if notify && !p.notified {
				decided() // no NOTIFY went out: the next writer sends one
			}
			return undo, fmt.Errorf("outbox: writing %d message(s) for topic %q: %w", n, topic, err)
		}
		if notify && !p.notified {
			undo = decided
		}
		p.notified = p.notified || notify
		p.wrote = true
		messages = messages[n:]
	}
	return undo, nil
}

// Close makes later Publish calls fail. It does not touch the transaction.
func (p *Publisher) Close() error {
	p.closed.Store(true)
	return nil
}

func init() {
	outboxnotify.AtCommit = func(tx wsql.ContextExecutor, db sqlschema.DB) (message.Publisher, func(context.Context) error, error) {
		p, err := NewPublisher(tx, db)
		if err != nil {
			return nil, nil, err
		}
		p.atCommit = true
		return p, p.beforeCommit, nil
	}
}

// beforeCommit sends the NOTIFY of a Publisher made by
// outboxnotify.AtCommit, right before its transaction commits: the
// debounce is then decided when the commit is one round trip away, so a
// transaction that skips its NOTIFY relies on one that commits at the same
// moment, not on one that wrote its rows earlier and may still run for
// long, or roll back.
func (p *Publisher) beforeCommit(ctx context.Context) error {
	if !p.wrote || p.notified {
		return nil
	}
	ok, undo := shouldNotify(p.gate, time.Now())
	if !ok {
		return nil
	}
	if _, err := p.db.ExecContext(ctx, "SELECT pg_notify("+quoteLiteral(p.channel)+", '')"); err != nil {
		undo()
		return fmt.Errorf("outbox: NOTIFY: %w", err)
	}
	p.notified = true
	return nil
}
