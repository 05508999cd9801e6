package inbox

import (
	"context"
	"fmt"
	"slices"
)

// MaxConsumers is the largest limit Consumers takes.
const MaxConsumers = 10000

// HasConsumer reports whether consumer has a record in the inbox or a
// parked message (a released key whose record was purged keeps its
// message): two primary-key look-ups, whatever the size of the table. A
// consumer name that has neither is most likely misspelled; tools say so
// instead of showing an empty result that reads as "all is well".
func (s *Store) HasConsumer(ctx context.Context, consumer string) (bool, error) {
	known, err := s.s.KnownConsumer(ctx, s.db.Conn, consumer)
	if err != nil {
		return false, s.fail("has consumer", err)
	}
	return known, nil
}

// Consumers returns the names of the consumers that have a record in the
// inbox or a parked message, in byte order, at most limit of them (1 to
// MaxConsumers; ask for one more than you show to know whether there are
// more). It reads each table's primary key by a loose index scan: one
// index descent per consumer, whatever the number of records. When there
// are more consumers than limit, the names returned are the first of each
// table in its collation's order (merged, then sorted by bytes).
func (s *Store) Consumers(ctx context.Context, limit int) ([]string, error) {
	if limit < 1 || limit > MaxConsumers {
		return nil, s.fail("consumers", fmt.Errorf("%w: limit %d: it must be between 1 and %d", ErrInvalidFilter, limit, MaxConsumers))
	}
	set := map[string]bool{}
	for _, parked := range []bool{false, true} { // the inbox, then the parked messages
		cs, err := s.s.Consumers(ctx, s.db.Conn, parked, limit)
		if err != nil {
			return nil, s.fail("consumers", err)
		}
		for _, c := range cs {
			set[c] = true
		}
	}
	names := make([]string, 0, len(set))
	for c := range set {
		names = append(names, c)
	}
	slices.Sort(names) // byte order: the two tables' collations may differ
	if len(names) > limit {
		names = names[:limit]
	}
	return names, nil
}
