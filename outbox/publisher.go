package outbox

import (
	"errors"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxwrite"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Writer writes messages to one outbox table through your transactions:
// Writer.Publisher(tx) returns the message.Publisher of one transaction.
// Make one per table and database when your service starts and keep it:
// it holds the wake-on-commit NOTIFY debounce of its Publishers (see
// Publisher.Publish), which needs to see all of a process's writes to the
// table. A process that writes to outbox tables of the same name in
// several databases (a database per tenant or shard) needs a Writer per
// database: a write through one Writer can skip the NOTIFY that the other
// database's Relay waits for. A Writer is safe for concurrent use. Inside
// a handler under the exactly-once middleware, use
// exactlyonce.OutboxFromContext instead: the middleware has its own.
type Writer struct {
	w *outboxwrite.Writer
}

// NewWriter returns a Writer for db's outbox table. db names the table; its
// Conn is not used (the transactions given to Writer.Publisher are). It
// does not touch the database.
func NewWriter(db sqlschema.DB) (*Writer, error) {
	w, err := outboxwrite.New(db)
	if err != nil {
		return nil, fmt.Errorf("outbox: NewWriter: %w", err)
	}
	return &Writer{w: w}, nil
}

// Publisher returns a Publisher that writes to the Writer's outbox table
// through tx: wsql.TxFromPgx(tx) or wsql.TxFromStdSQL(tx) from
// github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql. Any
// wsql.ContextExecutor works as tx. Given a wsql.Beginner that is not a
// transaction (wsql.BeginnerFromPgx(pool), wsql.BeginnerFromStdSQL(db)),
// each Publish is a transaction of its own, however many messages it
// writes, and the atomicity with your other writes is gone; any other
// executor is taken for a transaction, whose commit is the caller's. On
// MySQL such an executor must be in a transaction when the messages have
// ordering keys: a key's lock is a statement of its own there, which an
// autocommit session would release before the rows are written.
func (w *Writer) Publisher(tx wsql.ContextExecutor) (*Publisher, error) {
	if tx == nil {
		return nil, errors.New("outbox: Writer.Publisher: tx is nil")
	}
	return &Publisher{p: w.w.Publisher(tx)}, nil
}

// Publisher is a message.Publisher that writes messages to the outbox
// table through the transaction it is bound to (see Writer.Publisher).
// Published messages become visible to the Relay when that transaction
// commits, and vanish if it rolls back. Make one per transaction; it is
// cheap.
//
// The topic is a column of the outbox table, not a table name: any non-empty
// text (valid UTF-8 without NUL) is a topic, including "/", spaces and dots.
// watermill-sql's own publisher restricts topics to [A-Za-z0-9-$:._] because
// it makes a table per topic; that rule does not apply here. The broker may
// have rules of its own (RabbitMQ: routing keys up to 255 bytes); a row it
// refuses is quarantined by the Relay.
type Publisher struct {
	p *outboxwrite.Publisher
}

var _ message.Publisher = (*Publisher)(nil)

// Publish writes messages to the outbox with topic as their destination.
// Each keeps its UUID (which must not be empty) and metadata, to which
// Publish adds the W3C trace context (traceparent, tracestate) of the
// message's context when that holds an OpenTelemetry span and the metadata
// has no traceparent yet. A message with an ordering key (msgid.SetOrderingKey)
// takes its key's lock, in the statement that writes it, for the rest of
// the transaction: another transaction writing the same key waits here
// until this one ends, so that the key's messages are relayed in the order
// their transactions committed (see docs/ordering.md). Outside a
// transaction (see Writer.Publisher) each Publish is one transaction of
// its own, which holds the locks until its rows are committed: one INSERT,
// or, beyond 1,000 messages (one INSERT takes at most that many), several
// in a READ COMMITTED transaction that Publish begins, commits, and rolls
// back when one fails, leaving none of the call's rows. Every message is
// checked before any is written (a non-empty topic and UUID, valid UTF-8
// without NUL in the topic, UUID and metadata: the outbox keeps messages
// byte for byte), so a bad one leaves the transaction as it was. The SQL
// runs with the first message's context.
//
// On MySQL (sqlschema.MySQL) a key's lock is its row in the outbox's
// table of key locks (<outbox>_key_locks, a row per 16-bit hash of keys),
// which Publish upserts, in one order, in a statement before the INSERT;
// InnoDB holds the row's lock until the transaction ends, as PostgreSQL
// holds the advisory lock. Outside a transaction, a Publish with ordering
// keys is then a transaction that Publish begins and commits (READ
// COMMITTED), whatever its size. An INSERT there also takes at most 4 MiB
// of payloads and metadata (a statement is bounded by the server's
// max_allowed_packet).
//
// On PostgreSQL a write may also send a NOTIFY on the table's channel (at
// most one per 10 ms among the Publishers of a Writer; see
// RelayConfig.ListenConnString), which PostgreSQL delivers to listening
// Relays when the transaction commits. A write that failed sent none and
// leaves the debounce as it was; once one was sent, the later writes of
// the Publisher repeat it (PostgreSQL delivers one per transaction), so a
// ROLLBACK TO SAVEPOINT that discarded it does not leave the transaction
// without one. MySQL has no NOTIFY: the writes send nothing.
//
// Publish is not safe for concurrent use (neither is the transaction).
func (p *Publisher) Publish(topic string, messages ...*message.Message) error {
	return p.p.Publish(topic, messages...)
}

// Close makes later Publish calls fail. It does not touch the transaction.
func (p *Publisher) Close() error {
	return p.p.Close()
}
