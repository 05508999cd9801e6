package redisstore_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// GetParkedPrefix reads the fields GetParked reads, with at most the
// first bytes of the payload (all of it when shorter, none with 0) and its
// whole size; a message whose payload was not kept has none; a key
// without a message is not parked.
func TestRedisGetParkedPrefix(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	large := strings.Repeat("0123456789abcdef", 1<<16) // 1 MiB
	b.park(t, redisMsg{consumer: "c", key: "large", topic: "t", payload: large, meta: map[string]string{"order_id": "A-1"},
		reason: "too large", ago: time.Minute})
	b.park(t, redisMsg{consumer: "c", key: "small", topic: "t", payload: `{"n":1}`})
	b.park(t, redisMsg{consumer: "c", key: "gone", topic: "t", payload: strings.Repeat("x", 300), notKept: true})
	b.park(t, redisMsg{consumer: "c", key: "empty", topic: "t"})

	m, err := b.s.GetParkedPrefix(b.ctx, "c", "large", 10)
	require.NoError(t, err)
	whole, err := b.s.GetParked(b.ctx, "c", "large")
	require.NoError(t, err)
	require.Equal(t, large, string(whole.Payload))
	require.Equal(t, "0123456789", string(m.Payload))
	whole.Payload = m.Payload
	require.Equal(t, whole, m, "the fields of GetParked")
	require.Equal(t, len(large), m.PayloadSize)
	require.Equal(t, map[string]string{"order_id": "A-1"}, m.Metadata)

	m, err = b.s.GetParkedPrefix(b.ctx, "c", "small", 10)
	require.NoError(t, err)
	require.Equal(t, `{"n":1}`, string(m.Payload), "shorter than the bound: whole")

	m, err = b.s.GetParkedPrefix(b.ctx, "c", "large", 0)
	require.NoError(t, err)
	require.Empty(t, m.Payload)
	require.True(t, m.PayloadKept)

	m, err = b.s.GetParkedPrefix(b.ctx, "c", "empty", 10)
	require.NoError(t, err)
	require.Empty(t, m.Payload)
	require.True(t, m.PayloadKept)

	m, err = b.s.GetParkedPrefix(b.ctx, "c", "gone", 10)
	require.NoError(t, err)
	require.Nil(t, m.Payload)
	require.False(t, m.PayloadKept)
	require.Equal(t, 300, m.PayloadSize)

	_, err = b.s.GetParkedPrefix(b.ctx, "c", "nope", 10)
	require.ErrorIs(t, err, inbox.ErrNotParked)
	_, err = b.s.GetParkedPrefix(b.ctx, "c", "large", -1)
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
}

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
