package outboxdb

import (
	"context"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
)

// Insert is the rows of one INSERT: one message per index of UUIDs,
// Payloads, Metadata and OrderingKeys, in the order their ids are drawn.
type Insert struct {
	Topic        string
	UUIDs        []string
	Payloads     [][]byte // never nil ones: a payload is NOT NULL
	Metadata     []string // JSON objects
	OrderingKeys []string // "" for none
	// LockClass and Locks are the advisory locks (LockClass, k) taken, for
	// each k of Locks in that order, before the ids are drawn (see
	// write.sql's Insert). Locks may be empty.
	LockClass int32
	Locks     []int32
}

// Insert writes the rows in one statement; with notify, the same statement
// also sends the table's NOTIFY (write.sql's InsertNotify).
func (s *Store) Insert(ctx context.Context, q wsql.ContextExecutor, in Insert, notify bool) error {
	name := "Insert"
	if notify {
		name = "InsertNotify"
	}
	locks := in.Locks
	if locks == nil {
		locks = []int32{}
	}
	_, err := q.ExecContext(ctx, s.st.Get(name), in.Topic, in.UUIDs, in.Payloads, in.Metadata, in.OrderingKeys, in.LockClass, locks)
	return err
}

// Notify sends the table's NOTIFY, delivered when the transaction commits.
func (s *Store) Notify(ctx context.Context, q wsql.ContextExecutor) error {
	_, err := q.ExecContext(ctx, s.st.Get("Notify"))
	return err
}
