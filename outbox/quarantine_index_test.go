package outbox_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// The searches of Store.Find and Store.Count use outbox_001's partial
// quarantined_* indexes (or its failing index for failing rows) on 50,000
// rows of which 1,000 quarantined and 100 failing. With the values bound
// (the custom plans PostgreSQL keeps using while they cost less than its
// generic plan), each uses the index named; a generic plan (plan_cache_mode =
// force_generic_plan), which cannot know how selective a value is, may read
// the quarantined rows through another partial index instead, but never
// scans the table.
func TestQuarantineSearchUsesIndexes(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		const n = 50000
		// Row i: quarantined when i % 50 = 0, (i seconds before the last)
		// failing when i % 500 = 7; metadata order_id "ord-<i>".
		b.exec(t, `INSERT INTO `+b.tables.Outbox()+`
  (topic, uuid, payload, metadata, created_at, attempts, last_error, failures, next_attempt_at, quarantined_at)
SELECT 'topic-' || (i % 20), 'u-' || i, convert_to('{"order":' || i || '}', 'UTF8'),
  jsonb_build_object('order_id', 'ord-' || i, 'tenant', 't' || (i % 100)),
  now() - ($1 - i) * interval '1 second',
  CASE WHEN i % 50 = 0 THEN 5 ELSE 0 END,
  CASE WHEN i % 50 = 0 THEN 'message u-' || i || ' refused: PRECONDITION_FAILED' WHEN i % 500 = 7 THEN 'broker down' END,
  CASE WHEN i % 50 = 0 THEN 7 WHEN i % 500 = 7 THEN 2 ELSE 0 END,
  CASE WHEN i % 500 = 7 THEN now() + interval '1 hour' END,
  CASE WHEN i % 50 = 0 THEN now() - ($1 - i) * interval '1 second' END
FROM generate_series(1, $1::int) i`, n)
		b.exec(t, `ANALYZE `+b.tables.Outbox())
		db := b.schema()
		now := time.Now()
		index := func(suffix string) string { return b.tables.OutboxTable + "_" + suffix }
		for _, c := range []struct {
			name  string
			f     outbox.RowFilter
			count bool
			want  []string // indexes the custom plan uses
			wantN int
		}{
			{name: "metadata", f: outbox.RowFilter{Metadata: map[string]string{"order_id": "ord-25000"}}, want: []string{index("quarantined_metadata")}, wantN: 1},
			{name: "uuid", f: outbox.RowFilter{UUID: "u-25000"}, want: []string{index("quarantined_uuid")}, wantN: 1},
			{name: "time range", f: outbox.RowFilter{QuarantinedSince: now.Add(-2025 * time.Second), QuarantinedBefore: now.Add(-1025 * time.Second)},
				want: []string{index("quarantined_at")}, wantN: 20},
			{name: "page", f: outbox.RowFilter{}, wantN: 101},
			{name: "topic", f: outbox.RowFilter{Topic: "topic-0"}, wantN: 101},
			{name: "reason", f: outbox.RowFilter{Reason: "u-2500"}, wantN: 2},
			{name: "failing by metadata", f: outbox.RowFilter{State: outbox.StateFailing, Metadata: map[string]string{"order_id": "ord-25007"}},
				want: []string{index("failing")}, wantN: 1},
			{name: "all by metadata", f: outbox.RowFilter{State: outbox.StateAll, Metadata: map[string]string{"order_id": "ord-25007"}},
				want: []string{index("quarantined_metadata"), index("failing")}, wantN: 1},
			{name: "ids", f: outbox.RowFilter{IDs: []int64{50, 100, 150}}, want: []string{index("pkey")}, wantN: 3},
			{name: "count", f: outbox.RowFilter{}, count: true},
			{name: "count by metadata", f: outbox.RowFilter{Metadata: map[string]string{"order_id": "ord-30000"}}, count: true, want: []string{index("quarantined_metadata")}},
		} {
			query, args := outbox.FindSQL(db, c.f, 0, 101)
			if c.count {
				query, args = outbox.CountSQL(db, c.f)
			} else {
				var got int
				rs, err := b.db.QueryContext(b.ctx, query, args...)
				require.NoError(t, err)
				for rs.Next() {
					got++
				}
				require.NoError(t, seam.Close(rs))
				require.Equal(t, c.wantN, got, c.name)
			}
			custom := testenv.Explain(b.ctx, t, b.db, "EXPLAIN (ANALYZE, COSTS OFF) "+query, args...)
			t.Logf("%s: %s", c.name, custom[strings.LastIndex(custom, "Execution Time"):])
			require.NotContains(t, custom, "Seq Scan", "%s:\n%s", c.name, custom)
			for _, idx := range c.want {
				require.Contains(t, custom, idx, "%s:\n%s", c.name, custom)
			}

			tx := b.begin(t)
			_, err := tx.ExecContext(b.ctx, "SET LOCAL plan_cache_mode = force_generic_plan")
			require.NoError(t, err)
			_, err = tx.ExecContext(b.ctx, "PREPARE search AS "+query)
			require.NoError(t, err)
			literals := make([]string, len(args))
			for i, a := range args {
				literals[i] = "NULL" // a filter's field not set: the statement casts it
				if a != nil {
					literals[i] = testenv.SQLLiteral(t, a)
				}
			}
			execute := "EXECUTE search"
			if len(literals) > 0 {
				execute += "(" + strings.Join(literals, ", ") + ")"
			}
			generic := testenv.Explain(b.ctx, t, tx, "EXPLAIN (COSTS OFF) "+execute)
			_, err = tx.ExecContext(b.ctx, "DEALLOCATE search") // a session's, not the transaction's
			require.NoError(t, err)
			require.NoError(t, tx.Rollback())
			require.NotContains(t, generic, "Seq Scan", "%s, generic plan:\n%s", c.name, generic)
		}
	})
}
