package parked_test

import (
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/parked"
)

// A version starts with its kind, and one of another kind is refused as
// bad input (ErrInvalid), not taken for a change; equal states have equal
// versions, and a version changes with each part of the state it covers.
func TestVersionKinds(t *testing.T) {
	t.Parallel()
	at := time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC)
	later := at.Add(time.Microsecond)
	msg := parked.MessageVersion("u1", at, 2)
	rec := parked.RecordVersion("parked", 2, at, &later)
	row := parked.RowVersion(7, &at, 3, 1)
	require.True(t, strings.HasPrefix(msg, "msg-"), msg)
	require.True(t, strings.HasPrefix(rec, "rec-"), rec)
	require.True(t, strings.HasPrefix(row, "row-"), row)

	require.Equal(t, msg, parked.MessageVersion("u1", at, 2), "the same state")
	for name, other := range map[string]string{
		"another message":   parked.MessageVersion("u2", at, 2),
		"parked again":      parked.MessageVersion("u1", later, 2),
		"another attempt":   parked.MessageVersion("u1", at, 3),
		"record released":   parked.RecordVersion("failed", 2, at, &later),
		"record attempted":  parked.RecordVersion("parked", 3, at, &later),
		"record unfinished": parked.RecordVersion("parked", 2, at, nil),
		"row requeued":      parked.RowVersion(7, nil, 3, 1),
		"row failed again":  parked.RowVersion(7, &at, 4, 1),
	} {
		require.NotContains(t, []string{msg, rec, row}, other, name)
	}

	for _, tc := range []struct {
		name    string
		check   func() error
		invalid bool
	}{
		{"a message's version for a message", func() error { return parked.Expect{Version: msg}.ValidateMessage() }, false},
		{"a record's version for a message", func() error { return parked.Expect{Version: rec}.ValidateMessage() }, true},
		{"a record's version for a record", func() error { return parked.Expect{Version: rec}.ValidateRecord() }, false},
		{"a row's version for a record", func() error { return parked.Expect{Version: row}.ValidateRecord() }, true},
		{"a row's version for a row", func() error { return parked.CheckRowVersion(row) }, false},
		{"a message's version for a row", func() error { return parked.CheckRowVersion(msg) }, true},
		{"no version", func() error { return parked.Expect{MessageUUID: "u1"}.ValidateMessage() }, false},
		{"a NUL byte", func() error { return parked.Expect{MessageUUID: "u\x001"}.ValidateMessage() }, true},
		{"over 255 bytes", func() error { return parked.Expect{Status: strings.Repeat("s", 256)}.ValidateRecord() }, true},
	} {
		err := tc.check()
		if !tc.invalid {
			require.NoError(t, err, tc.name)
			continue
		}
		require.ErrorIs(t, err, parked.ErrInvalid, tc.name)
		require.NotErrorIs(t, err, parked.ErrChanged, tc.name)
	}
	require.True(t, parked.Expect{}.Empty())
	require.False(t, parked.Expect{Status: "parked"}.Empty())
}
