package outbox

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

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
		if err := checkText(msg.UUID); err != nil {
			return fmt.Errorf("outbox: Publish: message %d: UUID %w", i, err)
		}
		for k, v := range msg.Metadata {
			if err := checkText(k); err != nil {
				return fmt.Errorf("outbox: Publish: message %q: metadata key %q %w", msg.UUID, k, err)
			}
			if err := checkText(v); err != nil {
				return fmt.Errorf("outbox: Publish: message %q: metadata %q: value %w", msg.UUID, k, err)
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

// checkText rejects what the outbox cannot keep byte for byte: metadata is
// stored as JSON, which would silently replace invalid UTF-8, and
// PostgreSQL text and jsonb cannot hold NUL.
func checkText(s string) error {
	if !utf8.ValidString(s) {
		return errors.New("is not valid UTF-8 (it would not survive the outbox unchanged)")
	}
	if strings.IndexByte(s, 0) >= 0 {
		return errors.New("contains a NUL byte, which PostgreSQL cannot store")
	}
	return nil
}
