package inbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// HasConsumer knows a consumer by a record or a parked message; Consumers
// lists them in byte order, at most the limit asked for.
func TestConsumers(t *testing.T) {
	t.Parallel()
	db := testenv.Schema(t).WithDefaults()
	s, err := NewStore(db)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	names, err := s.Consumers(ctx, 10)
	require.NoError(t, err)
	require.Empty(t, names)
	known, err := s.HasConsumer(ctx, "charge-order")
	require.NoError(t, err)
	require.False(t, known)

	_, err = db.Conn.ExecContext(ctx, `INSERT INTO `+db.Inbox()+` (consumer, message_key, status, processed_at) VALUES
 ('send-sms', 'k1', 'done', now()), ('charge-order', 'k1', 'done', now()), ('charge-order', 'k2', 'parked', now()), ('Zed', 'k', 'done', now())`)
	require.NoError(t, err)
	// A released key whose record was purged: known by its message.
	_, err = db.Conn.ExecContext(ctx, `INSERT INTO `+s.s.ParkedTable()+` (consumer, message_key, message_uuid, topic, payload, payload_size, reason, attempts, first_seen_at)
 VALUES ('released', 'r1', 'u', 't', ''::bytea, 0, 'why', 1, now())`)
	require.NoError(t, err)

	for c, want := range map[string]bool{"charge-order": true, "released": true, "Zed": true, "charge_order": false, "": false} {
		known, err := s.HasConsumer(ctx, c)
		require.NoError(t, err)
		require.Equal(t, want, known, c)
	}
	names, err = s.Consumers(ctx, 10)
	require.NoError(t, err)
	require.Equal(t, []string{"Zed", "charge-order", "released", "send-sms"}, names)
	names, err = s.Consumers(ctx, 2)
	require.NoError(t, err)
	require.Len(t, names, 2)

	for _, limit := range []int{0, -1, MaxConsumers + 1} {
		_, err := s.Consumers(ctx, limit)
		require.ErrorIs(t, err, ErrInvalidFilter, "limit %d", limit)
	}
}

// The look-ups stay index look-ups on a large inbox, plain or partitioned:
// the existence check descends the primary keys, and the list of
// consumers is a loose index scan (one descent per consumer), never a
// scan or a sort of the records. 20000 records stand for millions: the
// plans are what matters.
func TestConsumersPlans(t *testing.T) {
	t.Parallel()
	for _, layout := range testenv.Layouts {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			db := testenv.SchemaLayout(t, layout).WithDefaults()
			s, err := NewStore(db)
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			_, err = db.Conn.ExecContext(ctx, `INSERT INTO `+db.Inbox()+` (consumer, message_key, status, processed_at)
 SELECT (ARRAY['charge-order', 'send-sms', 'ship-order'])[1 + i % 3], 'k' || i, 'done', now() FROM generate_series(1, 20000) i`)
			require.NoError(t, err)
			_, err = db.Conn.ExecContext(ctx, `INSERT INTO `+s.s.ParkedTable()+` (consumer, message_key, message_uuid, topic, payload, payload_size, reason, attempts, first_seen_at)
 VALUES ('ship-order', 'k3', 'u', 't', ''::bytea, 0, 'why', 1, now())`)
			require.NoError(t, err)
			for _, table := range []string{db.Inbox(), s.s.ParkedTable()} {
				_, err = db.Conn.ExecContext(ctx, "ANALYZE "+table)
				require.NoError(t, err)
			}
			plan := func(query string, args ...any) string {
				t.Helper()
				return testenv.Explain(ctx, t, db.Conn, "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) "+query, args...)
			}
			for _, p := range []string{
				plan(s.s.Statement("KnownConsumer"), "charge_order"),
				plan(s.s.Statement("Consumers"), 1001),
				plan(s.s.Statement("ParkedConsumers"), 1001),
			} {
				// A scan of the records would return or filter them out
				// by thousands (the planner may scan the small tables).
				require.NotRegexp(t, `rows=[1-9]\d{2,} |Rows Removed by Filter: [1-9]\d{2,}`, p, "no node reads hundreds of rows\n%s", p)
			}
			names, err := s.Consumers(ctx, 1001)
			require.NoError(t, err)
			require.Equal(t, []string{"charge-order", "send-sms", "ship-order"}, names, fmt.Sprint(layout))
		})
	}
}
