package outboxdb_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// PendingRows (the CLI's 'outbox pending') lists the oldest rows of a
// state, with the database's ages and a row's place behind a failed row
// of its key; Pending counts them. Both engines.
func TestPendingRows(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		s, err := outboxdb.New(b.DB)
		require.NoError(t, err)
		out := b.DB.Outbox()
		// id, uuid, key, state: 1 h1 k (never failed), 2 f1 k failing, 3 h2
		// k (blocked behind f1), 4 q1 - quarantined, 5 h3 - new.
		b.Exec(t, `INSERT INTO `+out+` (topic, uuid, payload, metadata, created_at, failures, attempts, next_attempt_at, quarantined_at, last_error, ordering_key) VALUES `+b.SQL(
			`('t', 'h1', '\x0102', '{}', now() - interval '1 hour', 0, 0, NULL, NULL, NULL, 'k'),
			 ('t', 'f1', '', '{}', now() - interval '50 minutes', 2, 0, now() + interval '10 minutes', NULL, 'broker down', 'k'),
			 ('t', 'h2', '', '{}', now() - interval '40 minutes', 0, 0, NULL, NULL, NULL, 'k'),
			 ('t', 'q1', '', '{}', now() - interval '30 minutes', 4, 3, NULL, now(), 'refused', NULL),
			 ('t', 'h3', '', '{}', now(), 0, 0, NULL, NULL, NULL, NULL)`,
			`('t', 'h1', X'0102', '{}', UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, 0, 0, NULL, NULL, NULL, 'k'),
			 ('t', 'f1', '', '{}', UTC_TIMESTAMP(6) - INTERVAL 50 MINUTE, 2, 0, UTC_TIMESTAMP(6) + INTERVAL 10 MINUTE, NULL, 'broker down', 'k'),
			 ('t', 'h2', '', '{}', UTC_TIMESTAMP(6) - INTERVAL 40 MINUTE, 0, 0, NULL, NULL, NULL, 'k'),
			 ('t', 'q1', '', '{}', UTC_TIMESTAMP(6) - INTERVAL 30 MINUTE, 4, 3, NULL, UTC_TIMESTAMP(6), 'refused', NULL),
			 ('t', 'h3', '', '{}', UTC_TIMESTAMP(6), 0, 0, NULL, NULL, NULL, NULL)`))

		uuids := func(rows []outboxdb.PendingRow) []string {
			out := []string{}
			for _, r := range rows {
				out = append(out, r.UUID)
			}
			return out
		}
		all, err := s.PendingRows(b.Ctx, b.DB.Conn, "", 10)
		require.NoError(t, err)
		require.Equal(t, []string{"h1", "f1", "h2", "q1", "h3"}, uuids(all))
		h1, f1, h2, q1 := all[0], all[1], all[2], all[3]
		require.InDelta(t, 3600, h1.AgeSeconds, 60)
		require.EqualValues(t, 2, h1.PayloadBytes)
		require.Equal(t, "k", h1.OrderingKey)
		require.False(t, h1.Blocked, "before the failed row of its key")
		require.Equal(t, 2, f1.Failures)
		require.NotNil(t, f1.NextAttemptAt)
		require.InDelta(t, 600, f1.NextInSeconds, 60)
		require.Equal(t, "broker down", f1.LastError)
		require.False(t, f1.Blocked, "failed itself")
		require.True(t, h2.Blocked, "behind f1")
		require.NotNil(t, q1.QuarantinedAt)
		require.Equal(t, 3, q1.PermanentFailures)
		require.Zero(t, q1.NextInSeconds)
		require.Empty(t, q1.OrderingKey)

		limited, err := s.PendingRows(b.Ctx, b.DB.Conn, "", 2)
		require.NoError(t, err)
		require.Equal(t, []string{"h1", "f1"}, uuids(limited))
		quarantined, err := s.PendingRows(b.Ctx, b.DB.Conn, "quarantined", 10)
		require.NoError(t, err)
		require.Equal(t, []string{"q1"}, uuids(quarantined))
		failing, err := s.PendingRows(b.Ctx, b.DB.Conn, "failing", 10)
		require.NoError(t, err)
		require.Equal(t, []string{"f1"}, uuids(failing))

		p, err := s.Pending(b.Ctx, b.DB.Conn)
		require.NoError(t, err)
		require.Equal(t, int64(5), p.Count)
		require.Equal(t, int64(1), p.Failing)
		require.Equal(t, int64(1), p.Quarantined)
		require.Equal(t, int64(1), p.BlockedKeys)
		require.Equal(t, int64(1), p.Blocked)
		require.NotNil(t, p.OldestAge)
		require.InDelta(t, 3600, *p.OldestAge, 60)
		require.WithinDuration(t, time.Now().Add(-time.Hour), *p.OldestCreatedAt, time.Minute)

		n, err := s.RequeueFailed(b.Ctx, b.DB.Conn)
		require.NoError(t, err)
		require.Equal(t, int64(2), n, "f1 and q1")
		p, err = s.Pending(b.Ctx, b.DB.Conn)
		require.NoError(t, err)
		require.Equal(t, outboxdb.Pending{Count: 5, OldestCreatedAt: p.OldestCreatedAt, OldestAge: p.OldestAge}, p)
	})
}
