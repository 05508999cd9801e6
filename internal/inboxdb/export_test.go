package inboxdb

import (
	"context"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/parked"
)

// PretendNewestPartitionEnds makes the store's claims fallback writes
// whose newest partition ends at end, whatever the catalog says: they are
// then recorded just before end, in the partition ending there, as when
// maintenance fell behind. Tests use it to place a claim in a past
// partition, across a boundary from another store's claims. A zero end
// undoes it (and the store re-reads the partitions at its next claim).
func (s *Store) PretendNewestPartitionEnds(end time.Time) {
	s.part.mu.Lock()
	defer s.part.mu.Unlock()
	s.part.pinned = end
	s.part.newest = time.Time{}
	s.part.checked = time.Time{}
}

// PretendPartitionsEnd makes the store believe, for an hour, that its
// newest partition ends at end, without asking the database: with end far
// ahead, its claims are recorded at clock_timestamp(), as when an operator
// removed partitions the store knew of.
func (s *Store) PretendPartitionsEnd(end time.Time) {
	s.part.mu.Lock()
	defer s.part.mu.Unlock()
	s.part.pinned = time.Time{}
	s.part.newest = end
	s.part.checked = time.Now().Add(time.Hour)
}

// KeysFirst reports whether FindParked reads f's page keys first (from
// the parked_consumer_at index) and then their rows.
func KeysFirst(f parked.Filter) bool { return keysFirst(f) }

// FindParkedSQL is the query FindParked runs, or with keysFirst the
// other one: the page's keys first (true) or the plain query (false).
func (s *Store) FindParkedSQL(f parked.Filter, c *parked.Cursor, limit int, payloads, keysFirst bool) (string, []any, error) {
	return s.findParkedSQL(f, c, limit, payloads, keysFirst)
}

// FindParkedWith is FindParked through the query of keysFirst.
func (s *Store) FindParkedWith(ctx context.Context, db wsql.ContextExecutor, f parked.Filter, c *parked.Cursor, limit int, payloads, keysFirst bool) ([]ParkedRow, error) {
	q, args, err := s.findParkedSQL(f, c, limit, payloads, keysFirst)
	if err != nil {
		return nil, err
	}
	return s.queryParked(ctx, db, q, args...)
}

// StatementNames lists the store's statements (queries/postgres), sorted.
func (s *Store) StatementNames() []string { return s.q.names() }
