package inbox

import (
	"context"
	"fmt"
	"slices"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
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
	for _, table := range []string{s.db.Inbox(), s.s.ParkedTable()} {
		rows, err := s.db.Conn.QueryContext(ctx, consumersSQL(table), limit)
		if err != nil {
			return nil, s.fail("consumers", err)
		}
		for rows.Next() {
			var c string
			if err := rows.Scan(&c); err != nil {
				_ = rows.Close()
				return nil, s.fail("consumers", err)
			}
			set[c] = true
		}
		if err := seam.Close(rows); err != nil {
			return nil, s.fail("consumers", err)
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

// consumersSQL lists the distinct consumers of table in order, at most $1,
// by a loose index scan of its primary key (consumer, message_key[,
// partition_at]): one index descent per consumer, whatever the number of
// records, where SELECT DISTINCT would read them all.
func consumersSQL(table string) string {
	return `WITH RECURSIVE c AS (
    (SELECT consumer FROM ` + table + ` ORDER BY consumer LIMIT 1)
  UNION ALL
    SELECT (SELECT t.consumer FROM ` + table + ` t WHERE t.consumer > c.consumer ORDER BY t.consumer LIMIT 1)
    FROM c WHERE c.consumer IS NOT NULL
)
SELECT consumer FROM c WHERE consumer IS NOT NULL LIMIT $1`
}
