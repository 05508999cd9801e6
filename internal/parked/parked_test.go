package parked_test

import (
	"encoding/base64"
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

// A cursor no page returned is refused as invalid, never passed to a
// store: a time out of any store's range (PostgreSQL: 22008), a consumer
// or key that no stored text can hold (NUL: 22021; not UTF-8).
func TestDecodeRefusesForgedCursors(t *testing.T) {
	t.Parallel()
	forge := func(js string) string { return base64.RawURLEncoding.EncodeToString([]byte(js)) }
	for _, js := range []string{
		`{"t":-9000000000000000000,"c":"c","k":"k"}`,
		`{"t":9000000000000000000,"c":"c","k":"k"}`,
		`{"t":-62135596800000001,"c":"c","k":"k"}`, // before year 1
		`{"t":253402300800000000,"c":"c","k":"k"}`, // year 10000
		`{"t":1,"c":"c\u0000","k":"k"}`,
		`{"t":1,"c":"c","k":"k\u0000"}`,
		"{\"t\":1,\"c\":\"c\",\"k\":\"\xff\"}",
	} {
		_, err := parked.Decode(forge(js))
		require.ErrorIs(t, err, parked.ErrInvalid, js)
	}
	for _, at := range []time.Time{time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC), time.Date(9999, 12, 31, 23, 59, 59, 999999000, time.UTC), time.Unix(0, 0).UTC()} {
		c, err := parked.Decode(parked.Cursor{ParkedAt: at, Consumer: "c", Key: "k"}.Encode())
		require.NoError(t, err, at)
		require.True(t, c.ParkedAt.Equal(at))
	}
}
