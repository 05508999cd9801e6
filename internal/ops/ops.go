// Package ops is the operator layer: the actions on inbox keys, parked
// messages and outbox rows (find, count, show, replay, discard, requeue,
// forget, release) as the console's API, its pages and the CLI run them,
// written once.
//
//   - Store is the contract of a store of keys and parked messages: the
//     PostgreSQL inbox (Postgres) and the Redis lease store (Redis) behind
//     one interface, a replay included (the Redis store's publishes
//     through a publisher of the caller's).
//   - Rows (outbox.go) is the outbox's rows, the one place this module's
//     tools call the outbox's operator functions.
//   - Run is the bulk protocol: count (a Confirmation: the number, its
//     as_of, and for rows its max_id) → the operator confirms → act on
//     what the count saw that still matches, refused (CountChangedError,
//     nothing done) when that is no longer the number confirmed.
//   - The words of a key's and a row's state (state.go), shown by the
//     console, printed by the CLI and sent in the API's JSON.
//
// The package is internal: a program of the user's acts through the
// public stores (*inbox.Store, *redisstore.Store, outbox's functions),
// which hold every precondition (inbox.Expect, outbox.Expect); what this
// layer adds is the tools' plumbing, free to change with them.
package ops

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The stores' names, as the console's API (?store=) and the tools name
// them.
const (
	StorePostgres = "postgres"
	StoreRedis    = "redis"
)

// Store is the operator contract of a store of inbox keys and their parked
// messages. The methods are inbox.Store's, with its errors (inbox.ErrNotFound,
// ErrNotParked, ErrChanged, ErrNotReplayable, ErrReplayInProgress,
// ErrTooBroad, ErrInvalidFilter), and a replay's publisher is the store's
// business.
type Store interface {
	// Name is StorePostgres or StoreRedis.
	Name() string

	Get(ctx context.Context, consumer, key string) (inbox.Record, error)
	Forget(ctx context.Context, consumer, key string, expect inbox.Expect) (bool, error)
	Release(ctx context.Context, consumer, key string, expect inbox.Expect) (bool, error)
	// Parked lists the consumer's parked keys, oldest first.
	Parked(ctx context.Context, consumer string, limit int) ([]inbox.Record, error)

	FindParked(ctx context.Context, f inbox.ParkedFilter, p inbox.Page) (inbox.ParkedPage, error)
	CountParked(ctx context.Context, f inbox.ParkedFilter) (int64, error)
	GetParked(ctx context.Context, consumer, key string) (inbox.ParkedMessage, error)
	GetParkedPrefix(ctx context.Context, consumer, key string, maxPayload int) (inbox.ParkedMessage, error)
	ReplayParked(ctx context.Context, consumer, key string, opts inbox.ReplayOptions) (inbox.ParkedMessage, error)
	ReplayParkedMatching(ctx context.Context, f inbox.ParkedFilter, opts inbox.ReplayOptions) (inbox.ReplayReport, error)
	DiscardParked(ctx context.Context, consumer, key string, opts inbox.DiscardOptions) error
	DiscardParkedMatching(ctx context.Context, f inbox.ParkedFilter, opts inbox.DiscardOptions) (int64, error)

	// Now is the store's clock, that of its parks: a count's as_of.
	Now(ctx context.Context) (time.Time, error)
	// KnownConsumer reports whether consumer has a record or a parked
	// message; a store that keeps no list of its consumers (Redis) says
	// true: there an unknown consumer finds nothing, as an idle one does.
	KnownConsumer(ctx context.Context, consumer string) (bool, error)
}

// RedisStore is what the layer needs of the Redis lease store: the
// methods of *redisstore.Store it calls. An interface, so that a tool over
// PostgreSQL alone imports no Redis client.
type RedisStore interface {
	FindParked(ctx context.Context, f inbox.ParkedFilter, p inbox.Page) (inbox.ParkedPage, error)
	CountParked(ctx context.Context, f inbox.ParkedFilter) (int64, error)
	GetParked(ctx context.Context, consumer, key string) (inbox.ParkedMessage, error)
	GetParkedPrefix(ctx context.Context, consumer, key string, maxPayload int) (inbox.ParkedMessage, error)
	DiscardParked(ctx context.Context, consumer, key string, opts inbox.DiscardOptions) error
	DiscardParkedMatching(ctx context.Context, f inbox.ParkedFilter, opts inbox.DiscardOptions) (int64, error)
	Get(ctx context.Context, consumer, key string) (inbox.Record, error)
	Forget(ctx context.Context, consumer, key string, expect inbox.Expect) (bool, error)
	Release(ctx context.Context, consumer, key string, expect inbox.Expect) (bool, error)
	Parked(ctx context.Context, consumer string, limit int) ([]inbox.Record, error)
	// ReplayParked and ReplayParkedMatching publish through pub: the
	// store has no outbox.
	ReplayParked(ctx context.Context, consumer, key string, pub message.Publisher, opts inbox.ReplayOptions) (inbox.ParkedMessage, error)
	ReplayParkedMatching(ctx context.Context, f inbox.ParkedFilter, pub message.Publisher, opts inbox.ReplayOptions) (inbox.ReplayReport, error)
	// CountParkedKeys counts the consumer's parked keys (the store keeps
	// no other count).
	CountParkedKeys(ctx context.Context, consumer string) (int64, error)
}

// Postgres is the PostgreSQL inbox of db as a Store.
func Postgres(s *inbox.Store, db sqlschema.DB) Store { return pgStore{Store: s, db: db} }

type pgStore struct {
	*inbox.Store
	db sqlschema.DB
}

func (pgStore) Name() string { return StorePostgres }

func (s pgStore) Now(ctx context.Context) (time.Time, error) { return dbNow(ctx, s.db) }

func (s pgStore) KnownConsumer(ctx context.Context, consumer string) (bool, error) {
	return s.HasConsumer(ctx, consumer)
}

// dbNow is the database's time: the clock of a count's as_of. It is read
// through the outbox's storage layer (any statement set of db would do:
// it is the database's now()); called once per bulk action, it renders
// that set for the call.
func dbNow(ctx context.Context, db sqlschema.DB) (time.Time, error) {
	st, err := outboxdb.New(db)
	if err != nil {
		return time.Time{}, err
	}
	return st.Now(ctx, db.Conn)
}

// Redis is the Redis lease store as a Store; its replays publish through
// the publisher pub returns (called at each replay: it may make one on
// first use, or return the error that says why there is none).
func Redis(s RedisStore, pub func() (message.Publisher, error)) Store {
	return redisStore{RedisStore: s, pub: pub}
}

type redisStore struct {
	RedisStore
	pub func() (message.Publisher, error)
}

func (redisStore) Name() string { return StoreRedis }

func (s redisStore) ReplayParked(ctx context.Context, consumer, key string, opts inbox.ReplayOptions) (inbox.ParkedMessage, error) {
	pub, err := s.pub()
	if err != nil {
		return inbox.ParkedMessage{}, err
	}
	return s.RedisStore.ReplayParked(ctx, consumer, key, pub, opts)
}

func (s redisStore) ReplayParkedMatching(ctx context.Context, f inbox.ParkedFilter, opts inbox.ReplayOptions) (inbox.ReplayReport, error) {
	pub, err := s.pub()
	if err != nil {
		return inbox.ReplayReport{}, err
	}
	return s.RedisStore.ReplayParkedMatching(ctx, f, pub, opts)
}

// Now is this process's clock (the Redis store stamps a park with Redis's
// clock, in milliseconds: keep the clocks in sync): the end of the current
// millisecond, once it has passed, so that a message parked before it was
// parked before the count that takes it reads the store.
func (redisStore) Now(context.Context) (time.Time, error) {
	t := time.Now().Truncate(time.Millisecond).Add(time.Millisecond)
	time.Sleep(time.Until(t))
	return t.UTC(), nil
}

func (redisStore) KnownConsumer(context.Context, string) (bool, error) { return true, nil }
