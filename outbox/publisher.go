package outbox

import (
	"errors"
	"fmt"

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

	// Logger receives watermill-sql's trace logs. Defaults to no logging.
	Logger watermill.LoggerAdapter
}

// Publisher is a message.Publisher that writes messages to the outbox
// table through the transaction it is bound to. Published messages become
// visible to the Relay when that transaction commits, and vanish if it rolls
// back. Create one per transaction; it is cheap.
type Publisher struct {
	pub *wsql.Publisher
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
	pub, err := wsql.NewPublisher(tx, wsql.PublisherConfig{
		SchemaAdapter: schemaAdapter{table: cfg.Tables.Outbox()},
	}, cfg.Logger)
	if err != nil {
		return nil, fmt.Errorf("outbox: %w", err)
	}
	return &Publisher{pub: pub}, nil
}

// Publish writes messages to the outbox with topic as their destination.
// Each keeps its UUID (which must not be empty) and metadata. The SQL runs
// with the first message's context.
func (p *Publisher) Publish(topic string, messages ...*message.Message) error {
	if topic == "" {
		return errors.New("outbox: Publish: empty destination topic")
	}
	// Check every message before writing any chunk, so that a bad message
	// does not leave the chunks before it written.
	for i, msg := range messages {
		if msg == nil {
			return fmt.Errorf("outbox: Publish: message %d is nil", i)
		}
		if msg.UUID == "" {
			return fmt.Errorf("outbox: Publish: message %d has an empty UUID; the next consumer's inbox needs it", i)
		}
		// Metadata is stored as JSON, which would silently replace invalid
		// UTF-8; PostgreSQL cannot hold NUL. Refuse rather than alter.
		if err := pgtext.Check(msg.UUID); err != nil {
			return fmt.Errorf("outbox: Publish: message %d: UUID %w", i, err)
		}
		for k, v := range msg.Metadata {
			if err := pgtext.Check(k); err != nil {
				return fmt.Errorf("outbox: Publish: message %q: metadata key %q %w (the outbox keeps messages byte for byte)", msg.UUID, k, err)
			}
			if err := pgtext.Check(v); err != nil {
				return fmt.Errorf("outbox: Publish: message %q: metadata %q: value %w (the outbox keeps messages byte for byte)", msg.UUID, k, err)
			}
		}
	}
	for len(messages) > 0 {
		n := min(len(messages), maxMessagesPerInsert)
		if err := p.pub.Publish(topic, messages[:n]...); err != nil {
			return fmt.Errorf("outbox: writing %d message(s) for topic %q: %w", n, topic, err)
		}
		messages = messages[n:]
	}
	return nil
}

// Close makes later Publish calls fail. It does not touch the transaction.
func (p *Publisher) Close() error { return p.pub.Close() }
