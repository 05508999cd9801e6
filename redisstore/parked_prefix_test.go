package redisstore_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// With MaxScan, a find or count of a consumer with more parked keys than
// that is refused (ErrTooBroad: the store reads each of them); with
// MaxCount, a count of more matches; the bulk operations ignore both.
func TestRedisParkedReadsBounded(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	for _, k := range []string{"k1", "k2", "k3", "k4"} {
		b.park(t, redisMsg{consumer: "big", key: k, topic: "t", reason: "card declined"})
	}
	b.park(t, redisMsg{consumer: "small", key: "k1", topic: "t", reason: "card declined"})

	_, err := b.s.FindParked(b.ctx, inbox.ParkedFilter{Consumer: "big", MaxScan: 3}, inbox.Page{})
	require.ErrorIs(t, err, inbox.ErrTooBroad)
	require.ErrorContains(t, err, `consumer "big" has more than 3`)
	_, err = b.s.CountParked(b.ctx, inbox.ParkedFilter{Consumer: "big", Reason: "card", MaxScan: 3})
	require.ErrorIs(t, err, inbox.ErrTooBroad)
	page, err := b.s.FindParked(b.ctx, inbox.ParkedFilter{Consumer: "big", MaxScan: 4}, inbox.Page{})
	require.NoError(t, err)
	require.Len(t, page.Messages, 4)
	n, err := b.s.CountParked(b.ctx, inbox.ParkedFilter{Consumer: "small", Reason: "card", MaxScan: 3})
	require.NoError(t, err)
	require.EqualValues(t, 1, n)

	_, err = b.s.CountParked(b.ctx, inbox.ParkedFilter{Consumer: "big", MaxCount: 3})
	require.ErrorIs(t, err, inbox.ErrTooBroad)
	require.ErrorContains(t, err, "more than 3 parked messages match")

	d, err := b.s.DiscardParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "big", MaxScan: 1, MaxCount: 1}, inbox.DiscardOptions{All: true})
	require.NoError(t, err)
	require.EqualValues(t, 4, d)
}
