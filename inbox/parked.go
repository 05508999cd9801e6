package inbox

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"maps"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxrow"
	"github.com/exactlyonce/watermill-exactlyonce/internal/parked"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
)

// Errors of the operations on parked messages.
var (
	// ErrInvalidFilter is returned (wrapped) for a request that cannot be
	// run: a ParkedFilter field that cannot match anything stored (text
	// that is not valid UTF-8 or holds a NUL byte, a tenant with ':', a
	// consumer name over 255 bytes, Before not after Since), a Page.Limit
	// or batch size out of range, a Page.After that no page returned, an
	// empty consumer or key, or a bulk operation with an empty filter and
	// without All. The error names the field. An unknown consumer is not
	// an error: it matches nothing.
	ErrInvalidFilter = parked.ErrInvalid

	// ErrNotParked is returned (wrapped) when a key has no parked message:
	// it was replayed, discarded or forgotten meanwhile (by another
	// operator, say), or never parked with its content. Nothing changed.
	ErrNotParked = inboxdb.ErrNoParkedMessage

	// ErrNotReplayable is returned (wrapped) when a parked message cannot
	// be replayed as it is; nothing changed. The error says why and what
	// to do: its payload was not kept (over the middleware's limit:
	// re-publish it from its source, then Release the key); its topic is
	// unknown (set ReplayOptions.Topic); its key was processed since it
	// was parked (status done: a replay would be a duplicate, Discard it);
	// or its key is being processed (a lease-mode attempt holds it: try
	// again once it ends).
	ErrNotReplayable = errors.New("the parked message cannot be replayed")

	// ErrReplayInProgress is returned (wrapped) by a store whose replay of
	// a parked message is not one transaction (the Redis store,
	// redisstore.Store): its ReplayParked (with ErrNotReplayable) and its
	// DiscardParked return it when a replay of the message is in flight,
	// another operator's or one whose process stopped before it ended
	// (it lapses after that store's replay timeout). Nothing changed; try
	// again later. The PostgreSQL inbox (Store) replays in one
	// transaction and never returns it.
	ErrReplayInProgress = errors.New("a replay of the parked message is in flight")

	// ErrTooBroad is returned (wrapped) by FindParked and CountParked for
	// a filter whose read would exceed its bound (ParkedFilter.MaxScan,
	// MaxCount); the error says which and how to narrow the filter.
	// Nothing was read.
	ErrTooBroad = parked.ErrTooBroad
)

// ParkedMessage is a message whose key was parked, as the middleware kept
// it with the park: what it was, why and when it was parked, and the
// key's inbox status now.
type ParkedMessage struct {
	// Consumer and Key are the inbox record's.
	Consumer string
	Key      string

	// UUID is the message's UUID; a replay publishes it with it.
	UUID string
	// Topic is the topic it was consumed from; "" when the middleware did
	// not know it (then a replay needs ReplayOptions.Topic).
	Topic string
	// Payload is the message's payload. It is nil when PayloadKept is
	// false, and in FindParked's pages unless Page.Payloads is set; from
	// GetParkedPrefix it holds at most the bytes asked for (PayloadSize
	// says whether it was cut).
	Payload []byte
	// PayloadSize is the payload's size in bytes, kept or not.
	PayloadSize int
	// PayloadKept reports whether the payload was kept: false when it was
	// larger than the middleware keeps. Such a message cannot be replayed.
	PayloadKept bool
	// Metadata is the message's metadata.
	Metadata map[string]string

	// Reason is why the key was parked (the handler's error, or the lease
	// mode's account of its interrupted attempts).
	Reason string
	// Attempts is the key's number of attempts when it was parked.
	Attempts int
	// FirstSeenAt is when the key was first claimed; ParkedAt when it was
	// parked.
	FirstSeenAt time.Time
	ParkedAt    time.Time

	// Status is the key's inbox status now: "parked" until the message is
	// replayed or the key released; "failed" once released (Release keeps
	// the message: it stays listed until replayed or discarded); "done"
	// when the key was processed since (a released key redelivered: a
	// replay is refused, discard it); "processing" while a lease-mode
	// attempt holds it; "" when the key has no record (removed by hand, or
	// purged after its release).
	Status string

	// Version identifies this message and the park that kept it: it
	// changes when the key's parked message is replaced (the key parked
	// again, with this message or another), and only then. Pass it in
	// Expect.Version to replay or discard exactly what was shown. Compare
	// it; never parse it.
	Version string
}

func parkedMessage(r inboxdb.ParkedRow) ParkedMessage {
	return ParkedMessage{
		Consumer: r.Consumer, Key: r.Key,
		UUID: r.Message.UUID, Topic: r.Message.Topic, Payload: r.Message.Payload, PayloadSize: r.Message.PayloadSize,
		PayloadKept: r.Kept, Metadata: r.Message.Metadata,
		Reason: r.Reason, Attempts: r.Attempts, FirstSeenAt: r.FirstSeenAt, ParkedAt: r.ParkedAt, Status: r.Status,
		Version: parked.MessageVersion(r.Message.UUID, r.ParkedAt, r.Attempts),
	}
}

// ParkedFilter selects parked messages. A message matches when it matches
// every field that is set; the zero value matches every parked message.
type ParkedFilter struct {
	// Consumer is the consumer's name (the router handler's, by
	// default). Required by the Redis store.
	Consumer string
	// Key is the inbox key, exactly as recorded: for a tenant-scoped
	// consumer, TenantKey(tenant, key).
	Key string
	// MessageUUID is the message's UUID.
	MessageUUID string
	// Tenant selects the keys of one tenant (keys scoped by
	// exactlyonce.KeyByTenant: those that start with the tenant and ':').
	Tenant string
	// Reason selects the messages whose reason contains this text, in any
	// case.
	Reason string
	// Since and Before select the messages parked at or after Since and
	// before Before; a zero time does not bound.
	Since  time.Time
	Before time.Time
	// Metadata selects the messages whose metadata has each of these
	// fields with exactly this value: a business id a producer sets, such
	// as {"order_id": "A-1042"}. The PostgreSQL store looks them up in an
	// index (metadata @> '{"order_id": "A-1042"}').
	Metadata map[string]string

	// MaxScan, when positive, bounds the work of FindParked and
	// CountParked for a filter that Scans (a reason; a tenant or a key
	// without the consumer: conditions no index serves): they are
	// refused, with an error wrapping ErrTooBroad, when the other
	// conditions select more than MaxScan messages to check them on, and
	// otherwise read only those (the PostgreSQL store counts them on its
	// indexes first, in the same snapshot). The Redis store, which has no
	// index but the consumer's parked set, refuses a consumer with more
	// than MaxScan parked keys. Defaults to 0: no bound. The bulk
	// operations ignore it (count first).
	MaxScan int
	// MaxCount, when positive, bounds CountParked: a count of more than
	// MaxCount messages is refused (ErrTooBroad); it counts at most
	// MaxCount+1. Defaults to 0: no bound.
	MaxCount int
}

// Scans reports whether f has a condition that the PostgreSQL store's
// indexes do not serve, which it checks on each message its other
// conditions select (on every message, when it has none): the reason's
// text, and a tenant or a key without the consumer (the indexes hold the
// key after the consumer). Bound such a read with MaxScan where one
// caller's request must not read the whole table (a console, an API).
func (f ParkedFilter) Scans() bool { return f.internal().Scans() }

func (f ParkedFilter) internal() parked.Filter {
	return parked.Filter{Consumer: f.Consumer, Key: f.Key, MessageUUID: f.MessageUUID, Tenant: f.Tenant, Reason: f.Reason,
		Since: f.Since, Before: f.Before, Metadata: f.Metadata, MaxScan: f.MaxScan, MaxCount: f.MaxCount}
}

// Page selects a page of FindParked's results.
type Page struct {
	// Limit is the page's size. Defaults to 100; at most 1000.
	Limit int
	// After is the previous page's ParkedPage.Next, to read the page
	// after it; "" reads the first page. Pages follow the oldest parked
	// first; a message parked (or parked again) after the first page was
	// read comes on a later page.
	After string
	// Payloads makes the page carry the payloads; without it
	// ParkedMessage.Payload is nil (GetParked shows one message with its
	// payload). Defaults to false.
	Payloads bool
}

// ParkedPage is a page of parked messages.
type ParkedPage struct {
	// Messages are the page's messages, oldest parked first.
	Messages []ParkedMessage
	// Next is the cursor of the page after this one (Page.After); "" when
	// this is the last page.
	Next string
}

// ReplayOptions tunes a replay.
type ReplayOptions struct {
	// Topic replaces the topic the message is published to; "" (the
	// default) publishes it to the topic it was consumed from. Use it for
	// a message whose topic is unknown, or to route a replay elsewhere
	// (the consumer of that topic must be the one whose inbox parked the
	// key, or the key stays parked for it).
	Topic string
	// BatchSize is the number of parked messages one transaction of
	// ReplayParkedMatching replays. Defaults to 100; at most 1000.
	BatchSize int
	// All lets ReplayParkedMatching run with an empty filter: every parked
	// message of every consumer. Defaults to false.
	All bool
	// Expect is what the operator was shown of the message (ReplayParked):
	// the replay happens only while the key's parked message still is so,
	// else it returns an error wrapping ErrChanged. Not for
	// ReplayParkedMatching, whose bound is the count the operator
	// confirmed. Defaults to the zero Expect: no check.
	Expect Expect
}

// ReplayReport is what ReplayParkedMatching did.
type ReplayReport struct {
	// Replayed counts the messages replayed.
	Replayed int64
	// Skipped counts the matching messages left as they were: not
	// replayable (see ErrNotReplayable), or replayed or discarded by
	// someone else meanwhile.
	Skipped int64
}

// DiscardOptions tunes a discard.
type DiscardOptions struct {
	// Forget also deletes the key's inbox record, so that a later
	// delivery of the key runs the handler, while the record still waits
	// for an operator (parked, or failed: released); a record done (its
	// message processed since) or processing (an attempt holds it) is
	// kept, or a later copy would run the handler again. Defaults to
	// false: the key stays recorded, as discarded when it was parked
	// (nothing lists, counts or alerts on it as parked any more), and a
	// late redelivery is still acknowledged without running, counted as a
	// duplicate.
	Forget bool
	// Expect is what the operator was shown of the message
	// (DiscardParked): the discard happens only while the key's parked
	// message still is so, else it returns an error wrapping ErrChanged.
	// Not for DiscardParkedMatching, whose bound is the count the operator
	// confirmed. Defaults to the zero Expect: no check.
	Expect Expect
	// BatchSize is the number of parked messages one transaction of
	// DiscardParkedMatching deletes. Defaults to 100; at most 1000.
	BatchSize int
	// All lets DiscardParkedMatching run with an empty filter: every
	// parked message of every consumer. Defaults to false.
	All bool
}

// FindParked returns a page of the parked messages that match f, oldest
// parked first; ParkedPage.Next reads the next one. The table's indexes
// serve the consumer (with or without the key), the message UUID, the
// metadata fields (a GIN index: a business id among a million parked
// messages is found in about a millisecond) and the time range; the
// reason, and a tenant or a key without its consumer, are checked on the
// rows the other fields select, or on every row (ParkedFilter.Scans): give
// a consumer or a time range with them on a large table, and bound the
// read with ParkedFilter.MaxScan where a caller may not (ErrTooBroad over
// it). A page reads no payload unless Page.Payloads.
func (s *Store) FindParked(ctx context.Context, f ParkedFilter, p Page) (ParkedPage, error) {
	pf := f.internal()
	if err := pf.Validate(); err != nil {
		return ParkedPage{}, s.fail("find parked", err)
	}
	limit, err := parked.Limit(p.Limit)
	if err != nil {
		return ParkedPage{}, s.fail("find parked", err)
	}
	after, err := parked.Decode(p.After)
	if err != nil {
		return ParkedPage{}, s.fail("find parked", err)
	}
	var rs []inboxdb.ParkedRow
	err = s.boundedRead(ctx, pf, func(db wsql.ContextExecutor) error {
		var err error
		rs, err = s.s.FindParked(ctx, db, pf, after, limit+1, p.Payloads)
		return err
	})
	if err != nil {
		return ParkedPage{}, s.fail("find parked", err)
	}
	var page ParkedPage
	if len(rs) > limit {
		rs = rs[:limit]
		page.Next = rs[limit-1].Cursor().Encode()
	}
	page.Messages = make([]ParkedMessage, len(rs))
	for i, r := range rs {
		page.Messages[i] = parkedMessage(r)
	}
	return page, nil
}

// CountParked counts the parked messages that match f: what a bulk replay
// or discard of f would work on (ask before you run one). A count reads
// the indexes, about a microsecond a match; ParkedFilter.MaxCount bounds
// it, and MaxScan a filter that Scans, as for FindParked.
func (s *Store) CountParked(ctx context.Context, f ParkedFilter) (int64, error) {
	pf := f.internal()
	if err := pf.Validate(); err != nil {
		return 0, s.fail("count parked", err)
	}
	var n int64
	err := s.boundedRead(ctx, pf, func(db wsql.ContextExecutor) error {
		var err error
		n, err = s.s.CountParked(ctx, db, pf)
		return err
	})
	return n, s.fail("count parked", err)
}

// boundedRead runs read (a find or count of f) on the database; for a
// filter with MaxScan that Scans, in a read-only REPEATABLE READ
// transaction that first refuses it when its indexed conditions select
// more than MaxScan messages (ErrTooBroad) and sets the plan that reads
// only those (inboxdb.Store.BoundedScan): the check and the read see the
// same messages, and the read's work is bounded by MaxScan.
func (s *Store) boundedRead(ctx context.Context, f parked.Filter, read func(db wsql.ContextExecutor) error) error {
	if f.MaxScan <= 0 || !f.Scans() {
		return read(s.db.Conn)
	}
	tx, err := s.db.Conn.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelRepeatableRead, ReadOnly: true})
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback() }() // read-only: nothing to keep
	if err := s.s.BoundedScan(ctx, tx, f); err != nil {
		return err
	}
	return read(tx)
}

// GetParked returns the parked message of (consumer, key) with its
// payload, or an error wrapping ErrNotParked. The payload is read whole
// (up to the middleware's MaxParkedPayload, 64 MiB at most): to show a
// message, GetParkedPrefix reads a bounded part of it.
func (s *Store) GetParked(ctx context.Context, consumer, key string) (ParkedMessage, error) {
	if err := parked.CheckKey(consumer, key); err != nil {
		return ParkedMessage{}, s.fail("get parked", err)
	}
	r, err := s.s.GetParked(ctx, s.db.Conn, consumer, key)
	if err != nil {
		return ParkedMessage{}, s.fail("get parked", err)
	}
	return parkedMessage(r), nil
}

// GetParkedPrefix is GetParked with at most the first maxPayload bytes of
// the payload in ParkedMessage.Payload (PayloadSize is the whole
// payload's size: the payload is cut when it is larger). The database
// reads and sends that prefix only, so that showing a message costs the
// same whatever its payload's size. maxPayload is at least 0 (0 reads no
// payload: whether the key has a parked message, and its fields).
func (s *Store) GetParkedPrefix(ctx context.Context, consumer, key string, maxPayload int) (ParkedMessage, error) {
	if err := parked.CheckKey(consumer, key); err != nil {
		return ParkedMessage{}, s.fail("get parked", err)
	}
	r, err := s.s.GetParkedPrefix(ctx, s.db.Conn, consumer, key, maxPayload)
	if err != nil {
		return ParkedMessage{}, s.fail("get parked", err)
	}
	return parkedMessage(r), nil
}

// ReplayParked delivers the parked message of (consumer, key) again, so
// that the consumer processes it once: in one transaction it releases the
// key (parked → failed, as Release does), writes the message to the
// outbox for its topic with its UUID, payload and metadata, and deletes
// the parked message. The relay publishes it once the transaction
// commits; the consumer's inbox then runs it (the key was released) once:
// a late redelivery of the original, or a second replay, is a duplicate.
// It returns the message as written (Topic is the topic it was written
// for; Status the key's status before the replay).
//
// It returns an error wrapping ErrNotParked when there is no parked
// message (replayed or discarded meanwhile: of two operators replaying one
// message at once, one writes it, the other gets this error),
// ErrNotReplayable (nothing changed) when it cannot be replayed as it is,
// or ErrChanged (nothing changed) when opts.Expect no longer holds.
// The key may also have been released already (status failed, or no
// record): then only the outbox row is written.
func (s *Store) ReplayParked(ctx context.Context, consumer, key string, opts ReplayOptions) (ParkedMessage, error) {
	if err := s.checkReplay(consumer, key, opts); err != nil {
		return ParkedMessage{}, s.fail("replay parked", err)
	}
	var out ParkedMessage
	err := s.inTx(ctx, func(tx wsql.Tx) error {
		var err error
		out, err = s.replay(ctx, tx, consumer, key, nil, opts)
		return err
	})
	if err != nil {
		return ParkedMessage{}, s.fail("replay parked", err)
	}
	return out, nil
}

// ReplayParkedTx is ReplayParked in tx, a transaction of the caller's,
// READ COMMITTED (under REPEATABLE READ or SERIALIZABLE a concurrent
// replay or park of the key makes it fail with a serialization failure):
// the release, the outbox row and the deletion become visible when tx
// commits, and vanish if it rolls back. Use it to record an audit row with
// the replay, say. After an error, roll tx back.
func (s *Store) ReplayParkedTx(ctx context.Context, tx wsql.Tx, consumer, key string, opts ReplayOptions) (ParkedMessage, error) {
	if err := s.checkReplay(consumer, key, opts); err != nil {
		return ParkedMessage{}, s.fail("replay parked", err)
	}
	out, err := s.replay(ctx, tx, consumer, key, nil, opts)
	if err != nil {
		return ParkedMessage{}, s.fail("replay parked", err)
	}
	return out, nil
}

// ReplayParkedMatching replays (as ReplayParked) every parked message that
// matches f, oldest parked first, in transactions of opts.BatchSize
// messages each, so that no lock is held for long; the messages of a
// transaction that failed are left as they were. Messages that cannot be
// replayed, or that another operator replays or discards meanwhile, are
// skipped and counted. It returns what it did, also when it stops early
// (an error, or ctx's end). An empty filter is refused unless opts.All.
// Count first (CountParked), and confirm.
func (s *Store) ReplayParkedMatching(ctx context.Context, f ParkedFilter, opts ReplayOptions) (ReplayReport, error) {
	pf := f.internal()
	batch, err := s.checkBulk(pf, opts.All, "ReplayOptions", opts.BatchSize)
	if err == nil && !opts.Expect.internal().Empty() {
		err = fmt.Errorf("%w: ReplayOptions.Expect is for ReplayParked (one message), not a bulk replay", ErrInvalidFilter)
	}
	if err == nil && opts.Topic != "" {
		err = checkTopic(opts.Topic)
	}
	if err == nil {
		pf, err = s.boundNow(ctx, pf)
	}
	if err != nil {
		return ReplayReport{}, s.fail("replay parked", err)
	}
	var rep ReplayReport
	var after *parked.Cursor
	for {
		if err := ctx.Err(); err != nil {
			return rep, s.fail("replay parked", err)
		}
		// The batch is chosen without locks; each message is then locked
		// (record, then message, as a park locks them) and checked again
		// against f: it may have been parked again since.
		rs, err := s.s.FindParked(ctx, s.db.Conn, pf, after, batch, false)
		if err != nil {
			return rep, s.fail("replay parked", err)
		}
		if len(rs) == 0 {
			return rep, nil
		}
		var done ReplayReport
		err = s.inTx(ctx, func(tx wsql.Tx) error {
			done = ReplayReport{}
			for _, r := range rs {
				_, err := s.replay(ctx, tx, r.Consumer, r.Key, &pf, opts)
				switch {
				case err == nil:
					done.Replayed++
				case errors.Is(err, ErrNotParked), errors.Is(err, ErrNotReplayable):
					done.Skipped++
				default:
					return err
				}
			}
			return nil
		})
		if err != nil {
			return rep, s.fail("replay parked", err)
		}
		rep.Replayed += done.Replayed
		rep.Skipped += done.Skipped
		if len(rs) < batch {
			return rep, nil
		}
		c := rs[len(rs)-1].Cursor()
		after = &c
	}
}

// DiscardParked deletes the parked message of (consumer, key). A parked
// key becomes discarded: it is no longer listed or counted as parked, and
// a late redelivery is still acknowledged without running (a duplicate);
// a released (failed) key stays failed. With opts.Forget the key's inbox
// record is deleted too while it waits for an operator, in the same
// transaction (the next delivery runs). It returns an error wrapping
// ErrNotParked when there is no parked message, or ErrChanged when
// opts.Expect no longer holds; nothing changed then.
func (s *Store) DiscardParked(ctx context.Context, consumer, key string, opts DiscardOptions) error {
	if err := checkOne(consumer, key, opts.Expect); err != nil {
		return s.fail("discard parked", err)
	}
	return s.fail("discard parked", s.inTx(ctx, func(tx wsql.Tx) error {
		return s.discard(ctx, tx, consumer, key, opts)
	}))
}

// DiscardParkedTx is DiscardParked in tx, a transaction of the caller's:
// the deletions become visible when tx commits. After an error, roll tx
// back.
func (s *Store) DiscardParkedTx(ctx context.Context, tx wsql.Tx, consumer, key string, opts DiscardOptions) error {
	if err := checkOne(consumer, key, opts.Expect); err != nil {
		return s.fail("discard parked", err)
	}
	return s.fail("discard parked", s.discard(ctx, tx, consumer, key, opts))
}

// DiscardParkedMatching deletes (as DiscardParked: parked keys become
// discarded) every parked message that matches f, oldest parked first, in
// transactions of opts.BatchSize messages each; a message another
// transaction holds (being replayed) is skipped. It returns the number deleted, also when it stops early (an
// error, or ctx's end). An empty filter is refused unless opts.All.
// Count first (CountParked), and confirm.
func (s *Store) DiscardParkedMatching(ctx context.Context, f ParkedFilter, opts DiscardOptions) (int64, error) {
	pf := f.internal()
	batch, err := s.checkBulk(pf, opts.All, "DiscardOptions", opts.BatchSize)
	if err == nil && !opts.Expect.internal().Empty() {
		err = fmt.Errorf("%w: DiscardOptions.Expect is for DiscardParked (one message), not a bulk discard", ErrInvalidFilter)
	}
	if err == nil {
		pf, err = s.boundNow(ctx, pf)
	}
	if err != nil {
		return 0, s.fail("discard parked", err)
	}
	var total int64
	for {
		if err := ctx.Err(); err != nil {
			return total, s.fail("discard parked", err)
		}
		var n int64
		err := s.inTx(ctx, func(tx wsql.Tx) error {
			var err error
			n, err = s.s.DiscardParkedBatch(ctx, tx, pf, batch, opts.Forget)
			return err
		})
		if err != nil {
			return total, s.fail("discard parked", err)
		}
		total += n
		if n < int64(batch) {
			return total, nil
		}
	}
}

func (s *Store) checkReplay(consumer, key string, opts ReplayOptions) error {
	if err := checkOne(consumer, key, opts.Expect); err != nil {
		return err
	}
	if opts.Topic != "" {
		return checkTopic(opts.Topic)
	}
	return nil
}

// checkOne checks the key and the Expect of an action on one key.
func checkOne(consumer, key string, e Expect) error {
	if err := parked.CheckKey(consumer, key); err != nil {
		return err
	}
	return e.internal().ValidateMessage()
}

func checkTopic(topic string) error {
	if err := pgtext.Check(topic); err != nil {
		return fmt.Errorf("%w: ReplayOptions.Topic: %w", ErrInvalidFilter, err)
	}
	return nil
}

// boundNow bounds a bulk operation to the messages parked before it began
// (the database's clock): a message parked again while it runs (its
// consumer failed again after a replay) is left for the next one, never
// replayed or discarded twice by one run.
func (s *Store) boundNow(ctx context.Context, f parked.Filter) (parked.Filter, error) {
	now, err := s.s.Now(ctx, s.db.Conn)
	if err != nil {
		return f, err
	}
	if f.Before.IsZero() || f.Before.After(now) {
		f.Before = now
	}
	return f, nil
}

func (s *Store) checkBulk(f parked.Filter, all bool, opts string, batchSize int) (int, error) {
	if err := f.Validate(); err != nil {
		return 0, err
	}
	if f.Empty() && !all {
		return 0, fmt.Errorf("%w: the filter is empty, which selects every parked message of every consumer, and %s.All is not set", ErrInvalidFilter, opts)
	}
	return parked.Batch(opts+".BatchSize", batchSize)
}

// replay replays the parked message of (consumer, key) in tx; with f, only
// if it still matches f.
func (s *Store) replay(ctx context.Context, tx wsql.Tx, consumer, key string, f *parked.Filter, opts ReplayOptions) (ParkedMessage, error) {
	r, err := s.s.LockParked(ctx, tx, consumer, key, f, true)
	if err != nil {
		return ParkedMessage{}, err
	}
	m := parkedMessage(r)
	if err := opts.Expect.internal().CheckMessage(consumer, key, m.now()); err != nil {
		return ParkedMessage{}, err
	}
	if err := replayable(m, opts); err != nil {
		return ParkedMessage{}, err
	}
	if m.Topic == "" || opts.Topic != "" {
		m.Topic = opts.Topic
	}
	if m.Status == inboxdb.StatusParked {
		released, err := s.s.Release(ctx, tx, consumer, key)
		if err != nil {
			return ParkedMessage{}, err
		}
		if !released { // cannot happen: the record is locked
			return ParkedMessage{}, fmt.Errorf("releasing %q for %q: the record is no longer parked", key, consumer)
		}
	}
	pub := s.outbox.Publisher(tx)
	msg := message.NewMessage(m.UUID, m.Payload)
	msg.Metadata = maps.Clone(m.Metadata)
	// The replay keeps the message's metadata as it was: no trace context
	// of the operator's call is added (the outbox adds the context's span
	// to a message without a traceparent).
	msg.SetContext(trace.ContextWithSpanContext(ctx, trace.SpanContext{}))
	if err := pub.Publish(m.Topic, msg); err != nil {
		return ParkedMessage{}, err
	}
	if _, err := s.s.DeleteParked(ctx, tx, consumer, key); err != nil {
		return ParkedMessage{}, err
	}
	return m, nil
}

// replayable returns an error wrapping ErrNotReplayable when m cannot be
// replayed with opts.
func replayable(m ParkedMessage, opts ReplayOptions) error {
	why := ""
	switch {
	case !m.PayloadKept:
		why = fmt.Sprintf("its payload (%d bytes) was over the size the middleware keeps: re-publish it from its source, then Release the key", m.PayloadSize)
	case m.Topic == "" && opts.Topic == "":
		why = "the topic it was consumed from is unknown: name one (ReplayOptions.Topic)"
	case m.Status == inboxdb.StatusDone:
		why = "its key was processed since it was parked (released, then delivered again): a replay would be a duplicate; discard it"
	case m.Status == inboxdb.StatusProcessing:
		why = "its key is being processed (a lease-mode attempt holds it): try again once the attempt ends"
	default:
		topic := m.Topic
		if opts.Topic != "" {
			topic = opts.Topic
		}
		err := outboxrow.Validate(topic, message.NewMessage(m.UUID, nil))
		if err == nil {
			return nil
		}
		// A message the outbox cannot take as it is (an empty UUID: a
		// producer that set none, under a key of its own).
		why = "the outbox cannot take it as it is (" + err.Error() + "): re-publish it from its source, then Release the key"
	}
	return fmt.Errorf("%w: %q for %q: %s", ErrNotReplayable, m.Key, m.Consumer, why)
}

// now is m as an Expect compares it.
func (m ParkedMessage) now() parked.MessageNow {
	return parked.MessageNow{UUID: m.UUID, ParkedAt: m.ParkedAt, Attempts: m.Attempts, Status: m.Status}
}

// discard deletes the parked message of (consumer, key) in tx, once it has
// locked the key (its record, then its message: the lock order of a park)
// and checked opts.Expect; a parked record becomes discarded, or with
// opts.Forget is deleted while it waits for an operator.
func (s *Store) discard(ctx context.Context, tx wsql.Tx, consumer, key string, opts DiscardOptions) error {
	r, err := s.s.LockParked(ctx, tx, consumer, key, nil, false)
	if err != nil {
		return err
	}
	if err := opts.Expect.internal().CheckMessage(consumer, key, parkedMessage(r).now()); err != nil {
		return err
	}
	var found bool
	if opts.Forget {
		found, err = s.s.DiscardForgetTx(ctx, tx, consumer, key)
	} else {
		found, err = s.s.DiscardTx(ctx, tx, consumer, key)
	}
	if err != nil {
		return err
	}
	if !found { // cannot happen: the message is locked
		return fmt.Errorf("%w (consumer %q, key %q)", ErrNotParked, consumer, key)
	}
	return nil
}

// txRetries bounds the runs of a transaction of inTx that lost a race
// (a serialization failure or a deadlock).
const txRetries = 3

// inTx runs fn in a READ COMMITTED transaction of its own and commits it;
// it runs it again, in a new transaction, after a serialization failure or
// a deadlock.
func (s *Store) inTx(ctx context.Context, fn func(tx wsql.Tx) error) error {
	for try := 1; ; try++ {
		err := s.inTxOnce(ctx, fn)
		if err == nil || try == txRetries || !pgerr.SerializationFailure(err) || ctx.Err() != nil {
			return err
		}
	}
}

func (s *Store) inTxOnce(ctx context.Context, fn func(tx wsql.Tx) error) error {
	tx, err := s.db.Conn.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}
