// Package outboxwrite writes messages to an outbox table: the INSERT, which
// takes the locks of the messages' ordering keys, and the wake-on-commit
// NOTIFY with its debounce (notify.go). On MySQL the keys' locks are rows
// of the outbox's table of key locks, upserted by a statement before the
// INSERT (lockBuckets), and there is no NOTIFY (the NOTIFY paths do
// nothing). Package outbox's Writer and
// Publisher wrap it for the application's own transactions; the
// middleware (package exactlyonce), which owns the commits of the
// transactions it writes in, uses it directly and sends the NOTIFY right
// before each commit (Writer.AtCommit, Publisher.BeforeCommit); inbox's
// replays use it as outbox.Publisher does.
package outboxwrite

import (
	"context"
	stdsql "database/sql"
	"fmt"
	"sync/atomic"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxrow"
	"github.com/exactlyonce/watermill-exactlyonce/internal/tracing"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// maxMessagesPerInsert bounds one INSERT (its values travel as arrays, so
// it is no longer PostgreSQL's limit of 65535 bind parameters: it keeps
// one statement's arrays, and the memory of the rows it sorts, bounded).
//
// On MySQL, whose INSERT binds five placeholders a row (1,000 rows: 5,000
// of the 65,535 one statement may have), an INSERT also ends before the
// message whose payload and metadata would take it past
// maxBytesPerInsertMySQL (it always has one message). A statement whose
// values are interpolated (go-sql-driver/mysql's interpolateParams=true)
// is one packet, which the server refuses beyond max_allowed_packet (16 MiB
// by default on MariaDB, 64 MiB on MySQL 8); server-side prepared
// statements send a large value apart (long data), but the bound costs
// them nothing either.
const maxMessagesPerInsert = 1000

// maxBytesPerInsertMySQL bounds the payloads and metadata of one INSERT on
// MySQL (see maxMessagesPerInsert).
const maxBytesPerInsertMySQL = 4 << 20

// chunk returns how many of messages, from the first, the next INSERT
// writes: at most maxMessagesPerInsert, and on MySQL at most
// maxBytesPerInsertMySQL of payloads and metadata (at least one message).
func (w *Writer) chunk(messages []*message.Message) int {
	n := min(len(messages), maxMessagesPerInsert)
	if !w.mysql {
		return n
	}
	size := 0
	for i, msg := range messages[:n] {
		size += len(msg.Payload)
		for k, v := range msg.Metadata {
			size += len(k) + len(v) + 6 // quotes, colon, comma
		}
		if i > 0 && size > maxBytesPerInsertMySQL {
			return i
		}
	}
	return n
}

// Writer writes to one outbox table (in one database) through the
// transactions of the Publishers it makes, and holds their NOTIFY
// debounce: the time of the latest NOTIFY one of them sent. Keep one per
// table and database for as long as you write to it. Safe for concurrent
// use.
type Writer struct {
	store     *outboxdb.Store
	lockClass int32 // the first value of the ordering keys' locks
	// mysql: the keys' locks are rows of the table of key locks, taken by
	// a statement of their own (see Publisher.Publish), and there is no
	// NOTIFY.
	mysql bool
	db    sqlschema.DB // names the table (committed)
	last  atomic.Int64
}

// New returns a Writer for db's outbox table. It does not touch the
// database; db.Conn is not used.
func New(db sqlschema.DB) (*Writer, error) {
	if err := db.Validate(); err != nil {
		return nil, err
	}
	store, err := outboxdb.New(db)
	if err != nil {
		return nil, err
	}
	return &Writer{store: store, lockClass: LockClass(store.Table()), mysql: db.Dialect == sqlschema.MySQL, db: db}, nil
}

// Publisher returns a Publisher writing through tx whose writes decide the
// NOTIFY (see notify.go): for a transaction whose commit the caller does
// not own.
func (w *Writer) Publisher(tx wsql.ContextExecutor) *Publisher {
	return &Publisher{w: w, db: tx}
}

// AtCommit returns a Publisher writing through tx whose writes send no
// NOTIFY: call its BeforeCommit right before tx commits.
func (w *Writer) AtCommit(tx wsql.ContextExecutor) *Publisher {
	return &Publisher{w: w, db: tx, atCommit: true}
}

// Publisher writes messages to its Writer's table through one transaction
// (or, given a wsql.Beginner that is not one, in a transaction of its own
// per Publish). It is not safe for concurrent use (neither is the
// transaction).
type Publisher struct {
	w        *Writer
	db       wsql.ContextExecutor
	notified bool // a write of this Publisher (its transaction) sent a NOTIFY
	atCommit bool // the writes send none: BeforeCommit does
	wrote    bool // a write succeeded
	closed   atomic.Bool
}

var _ message.Publisher = (*Publisher)(nil)

// Publish writes messages with topic as their destination (outbox.Publisher's
// Publish documents it).
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
	if p.w.mysql {
		lock = lockBuckets(lock)
	}
	// Outside a transaction, several statements must be one transaction:
	// more than one INSERT takes, or, on MySQL, the key locks' statement
	// and the INSERT after it (PostgreSQL's INSERT takes its locks).
	several := p.w.chunk(messages) < len(messages) || (p.w.mysql && len(lock) > 0)
	b, own := ownTransaction(p.db)
	if own && several {
		return p.publishInOwnTx(b, topic, messages, lock)
	}
	if _, err := p.insert(topic, messages, lock); err != nil {
		return err
	}
	if own && len(messages) > 0 {
		p.w.committed() // the INSERT was its own transaction
	}
	return nil
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

// publishInOwnTx writes messages, more than one INSERT takes (or, on
// MySQL, with ordering keys, whose locks are a statement of their own), in
// a transaction of its own begun on b (READ COMMITTED, whatever the
// database's default), so that the call is one transaction, as one INSERT
// would be: all rows or none are committed, and the keys' locks are held
// until all are, so no other writer of a key commits between the
// statements.
func (p *Publisher) publishInOwnTx(b wsql.Beginner, topic string, messages []*message.Message, lock []int32) error {
	ctx := messages[0].Context()
	tx, err := b.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("outbox: beginning the transaction of %d message(s) for topic %q: %w", len(messages), topic, err)
	}
	// The transaction's writes decide about its NOTIFY as a Publisher in
	// the caller's transaction would; a NOTIFY it sent is gone with it if
	// it does not commit.
	in := p.w.Publisher(tx)
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
	p.w.committed()
	return nil
}

// insert writes messages through p.db, at most maxMessagesPerInsert per
// INSERT (Writer.chunk). undo (never nil) takes back the debounce record
// of a NOTIFY that the call's writes sent, for a caller whose transaction
// then did not commit.
func (p *Publisher) insert(topic string, messages []*message.Message, lock []int32) (undo func(), err error) {
	undo = func() {}
	for len(messages) > 0 {
		n := p.w.chunk(messages)
		rows, err := insertRows(p.w.lockClass, topic, messages[:n], lock)
		if err != nil {
			return undo, err
		}
		// Once the transaction has a NOTIFY, every INSERT of it repeats
		// it: PostgreSQL sends one per transaction and channel anyway
		// (its cost, at commit, is paid already), and a ROLLBACK TO
		// SAVEPOINT may have discarded the earlier one with its rows.
		notify, decided := p.notified, func() {}
		if !notify && !p.atCommit && p.w.store.CanNotify() {
			notify, decided = p.w.shouldNotify(time.Now())
		}
		if err := p.w.store.Insert(messages[0].Context(), p.db, rows, notify); err != nil {
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

// BeforeCommit sends the NOTIFY of a Publisher made by Writer.AtCommit,
// right before its transaction commits, when a write of it succeeded and
// no writer of the Writer sent one within the debounce interval: the
// debounce is then decided when the commit is one round trip away, so a
// transaction that skips its NOTIFY relies on one that commits at the same
// moment, not on one that wrote its rows earlier and may still run for
// long, or roll back. Its error only means that no NOTIFY was sent (the
// transaction may be aborted, which its commit reports).
func (p *Publisher) BeforeCommit(ctx context.Context) error {
	if !p.wrote || p.notified || !p.w.store.CanNotify() {
		return nil
	}
	ok, undo := p.w.shouldNotify(time.Now())
	if !ok {
		return nil
	}
	if err := p.w.store.Notify(ctx, p.db); err != nil {
		undo()
		return fmt.Errorf("outbox: NOTIFY: %w", err)
	}
	p.notified = true
	return nil
}
