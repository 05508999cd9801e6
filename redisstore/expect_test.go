package redisstore_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// The Redis store's actions with an Expect: as the PostgreSQL store's
// (inbox's TestExpect), they act only while the key is what the operator
// was shown.
func TestRedisExpect(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	b.park(t, redisMsg{consumer: "c", key: "k", uuid: "u1", topic: "t", payload: "x"})
	m1, err := b.s.GetParked(b.ctx, "c", "k")
	require.NoError(t, err)
	r1, err := b.s.Get(b.ctx, "c", "k")
	require.NoError(t, err)
	require.NotEmpty(t, m1.Version)
	require.NotEmpty(t, r1.Version)

	// A duplicate is counted in the record: its version stays.
	_, err = leasestore.BackendOf(b.s).Claim(b.ctx, "c", "k", leasestore.Options{Lease: time.Minute})
	require.NoError(t, err)
	r, err := b.s.Get(b.ctx, "c", "k")
	require.NoError(t, err)
	require.Equal(t, r1.Duplicates+1, r.Duplicates)
	require.Equal(t, r1.Version, r.Version)

	pub := &publisher{}
	err = b.s.DiscardParked(b.ctx, "c", "k", inbox.DiscardOptions{Expect: inbox.Expect{MessageUUID: "u0"}})
	require.ErrorIs(t, err, inbox.ErrChanged)
	require.ErrorContains(t, err, "message u1")
	_, err = b.s.ReplayParked(b.ctx, "c", "k", pub, inbox.ReplayOptions{Expect: inbox.Expect{Version: "msg-0123456789abcdef"}})
	require.ErrorIs(t, err, inbox.ErrChanged)
	_, err = b.s.Forget(b.ctx, "c", "k", inbox.Expect{Status: "done"})
	require.ErrorIs(t, err, inbox.ErrChanged)
	_, err = b.s.Release(b.ctx, "c", "k", inbox.Expect{Version: "rec-0123456789abcdef"})
	require.ErrorIs(t, err, inbox.ErrChanged)
	require.Empty(t, pub.messages())
	require.Equal(t, "parked", b.status(t, "c", "k"))

	ok, err := b.s.Release(b.ctx, "c", "k", inbox.Expect{Version: r1.Version, Status: "parked", MessageUUID: "u1"})
	require.NoError(t, err)
	require.True(t, ok)
	r2, err := b.s.Get(b.ctx, "c", "k")
	require.NoError(t, err)
	require.NotEqual(t, r1.Version, r2.Version)
	_, err = b.s.Forget(b.ctx, "c", "k", inbox.Expect{Version: r1.Version})
	require.ErrorIs(t, err, inbox.ErrChanged)

	_, err = b.s.ReplayParked(b.ctx, "c", "k", pub, inbox.ReplayOptions{Expect: inbox.Expect{Version: m1.Version, MessageUUID: "u1"}})
	require.NoError(t, err)
	b.park(t, redisMsg{consumer: "c", key: "k", uuid: "u2", topic: "t", payload: "y"})
	m2, err := b.s.GetParked(b.ctx, "c", "k")
	require.NoError(t, err)
	require.NotEqual(t, m1.Version, m2.Version)
	err = b.s.DiscardParked(b.ctx, "c", "k", inbox.DiscardOptions{Expect: inbox.Expect{Version: m1.Version}})
	require.ErrorIs(t, err, inbox.ErrChanged)
	require.ErrorContains(t, err, "message u2")
	require.NoError(t, b.s.DiscardParked(b.ctx, "c", "k", inbox.DiscardOptions{Expect: inbox.Expect{Version: m2.Version}}))
	require.Equal(t, "discarded", b.status(t, "c", "k"))

	_, err = b.s.Forget(b.ctx, "c", "nope", inbox.Expect{Status: "parked"})
	require.ErrorIs(t, err, inbox.ErrNotFound)
	_, err = b.s.DiscardParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.DiscardOptions{All: true, Expect: inbox.Expect{Version: m2.Version}})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
}
