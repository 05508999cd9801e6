package inbox_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
)

// An action given an Expect acts only while the key is what the operator
// was shown, and otherwise changes nothing and says what the key is now
// (ErrChanged); versions change with what they stand for, and only then.
func TestExpect(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, b bundle) {
		b.seed(t, parkedMsg{consumer: "c", key: "k", uuid: "u1", topic: "t", payload: []byte("x")})
		m1, err := b.store.GetParked(b.ctx, "c", "k")
		require.NoError(t, err)
		r1, err := b.store.Get(b.ctx, "c", "k")
		require.NoError(t, err)
		require.NotEmpty(t, m1.Version)
		require.NotEmpty(t, r1.Version)

		// A duplicate is counted in the record: its version stays.
		require.False(t, b.claimed(t, "c", "k"))
		r, err := b.store.Get(b.ctx, "c", "k")
		require.NoError(t, err)
		require.Equal(t, r1.Duplicates+1, r.Duplicates)
		require.Equal(t, r1.Version, r.Version, "counting a duplicate does not change the record's version")

		// Preconditions that do not hold: nothing done.
		err = b.store.DiscardParked(b.ctx, "c", "k", inbox.DiscardOptions{Expect: inbox.Expect{MessageUUID: "u0"}})
		require.ErrorIs(t, err, inbox.ErrChanged)
		require.ErrorContains(t, err, "message u1")
		_, err = b.store.ReplayParked(b.ctx, "c", "k", inbox.ReplayOptions{Expect: inbox.Expect{Version: "msg-0123456789abcdef"}})
		require.ErrorIs(t, err, inbox.ErrChanged)
		_, err = b.store.ReplayParked(b.ctx, "c", "k", inbox.ReplayOptions{Expect: inbox.Expect{Status: "failed"}})
		require.ErrorIs(t, err, inbox.ErrChanged)
		_, err = b.store.Forget(b.ctx, "c", "k", inbox.Expect{Status: "done"})
		require.ErrorIs(t, err, inbox.ErrChanged)
		require.ErrorContains(t, err, "now parked")
		_, err = b.store.Release(b.ctx, "c", "k", inbox.Expect{MessageUUID: "u0"})
		require.ErrorIs(t, err, inbox.ErrChanged)
		require.Empty(t, b.outbox(t))
		m, err := b.store.GetParked(b.ctx, "c", "k")
		require.NoError(t, err)
		require.Equal(t, m1, m, "untouched")

		// Released: the record's version changes, the message's does not.
		ok, err := b.store.Release(b.ctx, "c", "k", inbox.Expect{Version: r1.Version, Status: "parked", MessageUUID: "u1"})
		require.NoError(t, err)
		require.True(t, ok)
		r2, err := b.store.Get(b.ctx, "c", "k")
		require.NoError(t, err)
		require.NotEqual(t, r1.Version, r2.Version)
		m, err = b.store.GetParked(b.ctx, "c", "k")
		require.NoError(t, err)
		require.Equal(t, m1.Version, m.Version)
		_, err = b.store.Forget(b.ctx, "c", "k", inbox.Expect{Version: r1.Version})
		require.ErrorIs(t, err, inbox.ErrChanged, "the record shown parked was released since")

		// Replayed, and the key parked again with another message: the
		// message's version and UUID tell the two apart.
		_, err = b.store.ReplayParked(b.ctx, "c", "k", inbox.ReplayOptions{Expect: inbox.Expect{Version: m1.Version, MessageUUID: "u1"}})
		require.NoError(t, err)
		b.seed(t, parkedMsg{consumer: "c", key: "k", uuid: "u2", topic: "t", payload: []byte("y")})
		m2, err := b.store.GetParked(b.ctx, "c", "k")
		require.NoError(t, err)
		require.NotEqual(t, m1.Version, m2.Version)
		err = b.store.DiscardParked(b.ctx, "c", "k", inbox.DiscardOptions{Expect: inbox.Expect{Version: m1.Version}})
		require.ErrorIs(t, err, inbox.ErrChanged)
		require.ErrorContains(t, err, "message u2")
		err = b.store.DiscardParked(b.ctx, "c", "k", inbox.DiscardOptions{Forget: true, Expect: inbox.Expect{MessageUUID: "u1"}})
		require.ErrorIs(t, err, inbox.ErrChanged)
		require.Equal(t, "parked", b.status(t, "c", "k"))
		require.NoError(t, b.store.DiscardParked(b.ctx, "c", "k", inbox.DiscardOptions{Expect: inbox.Expect{Version: m2.Version}}))
		require.Equal(t, "discarded", b.status(t, "c", "k"))

		// A key without a record: not found, whatever the expectation.
		_, err = b.store.Forget(b.ctx, "c", "nope", inbox.Expect{Status: "parked"})
		require.ErrorIs(t, err, inbox.ErrNotFound)
		_, err = b.store.Release(b.ctx, "c", "nope", inbox.Expect{Status: "parked"})
		require.ErrorIs(t, err, inbox.ErrNotFound)

		// Bulk actions are bounded by their count, not by an Expect.
		_, err = b.store.DiscardParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.DiscardOptions{Expect: inbox.Expect{Version: m2.Version}})
		require.ErrorIs(t, err, inbox.ErrInvalidFilter)
		_, err = b.store.ReplayParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.ReplayOptions{Expect: inbox.Expect{Version: m2.Version}})
		require.ErrorIs(t, err, inbox.ErrInvalidFilter)
		_, err = b.store.Forget(b.ctx, "c", "k", inbox.Expect{Version: "a\x00b"})
		require.ErrorIs(t, err, inbox.ErrInvalidFilter)
		// A version of another kind is refused as such, not taken for a
		// change: a message's for a record, a record's for a message.
		_, err = b.store.Release(b.ctx, "c", "k", inbox.Expect{Version: m2.Version})
		require.ErrorIs(t, err, inbox.ErrInvalidFilter)
		require.ErrorContains(t, err, "not the version of a key's record: give the version inbox show")
		r3, err := b.store.Get(b.ctx, "c", "k")
		require.NoError(t, err)
		_, err = b.store.ReplayParked(b.ctx, "c", "k", inbox.ReplayOptions{Expect: inbox.Expect{Version: r3.Version}})
		require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	})
}
