package outbox

import (
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// maxMessagesPerInsert keeps one INSERT well under PostgreSQL's limit of
// 65535 bind parameters (4 per message).
const maxMessagesPerInsert = 1000

// PublisherConfig configures a Publisher. The zero value is valid.
type PublisherConfig struct {
	// Tables names the outbox table. Defaults to sqlschema's defaults
	// (public.watermill_outbox).
	Tables sqlschema.Config

	// Logger receives trace logs of the writes. Defaults to no logging.
	Logger watermill.LoggerAdapter
}

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
	db      wsql.ContextExecutor
	adapter schemaAdapter
	logger  watermill.LoggerAdapter
	closed  atomic.Bool
}

var _ message.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher bound to tx: sql.TxFromPgx(tx) or
// sql.TxFromStdSQL(tx) from github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql.
// Any sql.ContextExecutor works, but outside a transaction each Publish
// commits on its own, and the atomicity with your other writes is gone.
func NewPublisher(tx wsql.ContextExecutor, cfg PublisherConfig) (*Publisher, error) {
	if tx == nil {
		return nil, errors.New("outbox: NewPublisher: tx is nil")
	}
	if err := cfg.Tables.Validate(); err != nil {
		return nil, fmt.Errorf("outbox: PublisherConfig.Tables: %w", err)
	}
	logger := cfg.Logger
	if logger == nil {
		logger = watermill.NopLogger{}
	}
	return &Publisher{db: tx, adapter: schemaAdapter{table: cfg.Tables.Outbox()}, logger: logger}, nil
}

// Validate reports whether Publish would accept messages for topic: a
// non-empty topic that is valid UTF-8 without NUL, and messages that are not
// nil, have a UUID, and whose UUID and metadata keys and values are valid
// UTF-8 without NUL (the outbox keeps messages byte for byte; JSON would
// silently alter them). It touches no database.
func Validate(topic string, messages ...*message.Message) error {
	if topic == "" {
		return errors.New("outbox: empty destination topic")
	}
	if err := pgtext.Check(topic); err != nil {
		return fmt.Errorf("outbox: destination topic %q: %w", topic, err)
	}
	for i, msg := range messages {
		if msg == nil {
			return fmt.Errorf("outbox: message %d is nil", i)
		}
		if msg.UUID == "" {
			return fmt.Errorf("outbox: message %d has an empty UUID; the next consumer's inbox needs it", i)
		}
		if err := pgtext.Check(msg.UUID); err != nil {
			return fmt.Errorf("outbox: message %d: UUID %w", i, err)
		}
		for k, v := range msg.Metadata {
			if err := pgtext.Check(k); err != nil {
				return fmt.Errorf("outbox: message %q: metadata key %q %w (the outbox keeps messages byte for byte)", msg.UUID, k, err)
			}
			if err := pgtext.Check(v); err != nil {
				return fmt.Errorf("outbox: message %q: metadata %q: value %w (the outbox keeps messages byte for byte)", msg.UUID, k, err)
			}
		}
	}
	return nil
}

// Publish writes messages to the outbox with topic as their destination.
// Each keeps its UUID (which must not be empty) and metadata. Every message
// is checked (see Validate) before any is written, so a bad one leaves the
// transaction as it was. The SQL runs with the first message's context.
func (p *Publisher) Publish(topic string, messages ...*message.Message) error {
	if p.closed.Load() {
		return wsql.ErrPublisherClosed
	}
	if err := Validate(topic, messages...); err != nil {
		return fmt.Errorf("outbox: Publish: %w", err)
	}
	for len(messages) > 0 {
		n := min(len(messages), maxMessagesPerInsert)
		q, err := p.adapter.InsertQuery(wsql.InsertQueryParams{Topic: topic, Msgs: messages[:n]})
		if err != nil {
			return err
		}
		p.logger.Trace("outbox: writing messages", watermill.LogFields{"topic": topic, "count": n})
		if _, err := p.db.ExecContext(messages[0].Context(), q.Query, q.Args...); err != nil {
			return fmt.Errorf("outbox: writing %d message(s) for topic %q: %w", n, topic, err)
		}
		messages = messages[n:]
	}
	return nil
}

// Close makes later Publish calls fail. It does not touch the transaction.
func (p *Publisher) Close() error {
	p.closed.Store(true)
	return nil
}
