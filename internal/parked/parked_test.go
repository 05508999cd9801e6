package parked_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/parked"
)

func TestCursorRoundTrip(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 3, 4, 5, 6, 7, 123456789, time.UTC)
	c := parked.Cursor{ParkedAt: at, Consumer: "c/ü", Key: "tenant:k 1"}
	got, err := parked.Decode(c.Encode())
	require.NoError(t, err)
	require.Equal(t, parked.Cursor{ParkedAt: at.Truncate(time.Microsecond), Consumer: c.Consumer, Key: c.Key}, *got)
	none, err := parked.Decode("")
	require.NoError(t, err)
	require.Nil(t, none)
	for _, bad := range []string{"x", "e30", "!!"} {
		_, err := parked.Decode(bad)
		require.ErrorIs(t, err, parked.ErrInvalid, bad)
	}

	// The order of pages: parked time, then consumer, then key.
	require.True(t, got.Precedes(at.Add(time.Microsecond), "a", "a"))
	require.False(t, got.Precedes(at.Add(-time.Microsecond), "z", "z"))
	require.True(t, got.Precedes(at.Add(-700*time.Nanosecond), "c/ü", "tenant:k 2"), "compared at microseconds")
	require.False(t, got.Precedes(at, "c/ü", "tenant:k 1"), "itself")
	require.True(t, got.Precedes(at, "d", ""))
}

func TestMatch(t *testing.T) {
	t.Parallel()
	now := time.Now()
	m := parked.Message{Consumer: "c", Key: "acme:1", UUID: "u", Reason: "Bad Address", ParkedAt: now,
		Metadata: map[string]string{"order_id": "A-1", "empty": ""}}
	for _, f := range []parked.Filter{
		{}, {Consumer: "c"}, {Key: "acme:1"}, {MessageUUID: "u"}, {Tenant: "acme"}, {Reason: "address"}, {Reason: "BAD"},
		{Since: now}, {Before: now.Add(time.Nanosecond)}, {Metadata: map[string]string{"order_id": "A-1"}},
		{Metadata: map[string]string{"empty": ""}},
	} {
		require.True(t, f.Match(m), "%+v", f)
	}
	for _, f := range []parked.Filter{
		{Consumer: "d"}, {Key: "acme"}, {MessageUUID: "v"}, {Tenant: "acm"}, {Reason: "phone"},
		{Since: now.Add(time.Nanosecond)}, {Before: now}, {Metadata: map[string]string{"order_id": "A-2"}},
		{Metadata: map[string]string{"missing": ""}},
	} {
		require.False(t, f.Match(m), "%+v", f)
	}
}
