package redisstore

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// The second step of an action with an Expect: its script acts only while
// the record holds the fields the check read (its guard). A change between
// the check and the script, here made by hand, is refused by every script,
// and nothing is changed.
func TestGuardRefusesAChangeBetweenCheckAndAction(t *testing.T) {
	t.Parallel()
	c := testenv.Redis(t)
	s, err := New(Config{Client: c, Prefix: testenv.RedisPrefix(t, c)})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	claim, err := s.b.Claim(ctx, "c", "k", leasestore.Options{Lease: time.Minute})
	require.NoError(t, err)
	require.NoError(t, s.b.Fail(ctx, leasestore.Attempt{Consumer: "c", Key: "k", Token: claim.Token}, "bad", true))
	require.NoError(t, c.HSet(ctx, s.b.recordKey("c", "k"), "m_uuid", "u1", "m_topic", "t", "m_payload", "p", "m_size", 1,
		"parked_at_ms", 1000).Err())

	st, err := s.readState(ctx, "c", "k")
	require.NoError(t, err)
	g := st.guard()
	// Parked again with another message after the check.
	require.NoError(t, c.HSet(ctx, s.b.recordKey("c", "k"), "m_uuid", "u2", "parked_at_ms", 2000).Err())

	require.ErrorIs(t, s.discard(ctx, "c", "k", g, inbox.DiscardOptions{}), inbox.ErrChanged)
	_, err = s.replay(ctx, "c", "k", g, &sink{}, inbox.ReplayOptions{})
	require.ErrorIs(t, err, inbox.ErrChanged)
	_, err = s.b.forget(ctx, "c", "k", g)
	require.ErrorIs(t, err, inbox.ErrChanged)
	_, err = s.b.release(ctx, "c", "k", g)
	require.ErrorIs(t, err, inbox.ErrChanged)
	m, err := s.GetParked(ctx, "c", "k")
	require.NoError(t, err)
	require.Equal(t, "u2", m.UUID, "nothing changed")
	require.Equal(t, "parked", m.Status)

	// The guard of the state as it is now holds.
	st, err = s.readState(ctx, "c", "k")
	require.NoError(t, err)
	require.NoError(t, s.discard(ctx, "c", "k", st.guard(), inbox.DiscardOptions{}))
}
