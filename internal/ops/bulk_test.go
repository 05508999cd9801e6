package ops

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// fakeTarget is a Target over a number of matches (pure logic: the
// protocol, not a store).
type fakeTarget struct {
	now              time.Time
	count, recount   int64
	acted            *int
	actErr           error
	done, doneOnFail int64
}

func (f fakeTarget) Noun() (string, string)                 { return "row", "rows" }
func (f fakeTarget) Now(context.Context) (time.Time, error) { return f.now, nil }
func (f fakeTarget) Count(context.Context) (Confirmation, error) {
	return Confirmation{Count: f.count, AsOf: f.now, MaxID: 9}, nil
}
func (f fakeTarget) Recount(context.Context, Confirmation) (int64, error) { return f.recount, nil }
func (f fakeTarget) Act(context.Context, Confirmation) (int64, int64, error) {
	*f.acted++
	if f.actErr != nil {
		return f.doneOnFail, 0, f.actErr
	}
	return f.done, 1, nil
}

func TestRun(t *testing.T) {
	ctx := context.Background()
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	acted := 0
	// The count confirmed still holds: act.
	res, err := Run(ctx, fakeTarget{now: now, recount: 3, done: 3, acted: &acted}, Confirmation{Count: 3, AsOf: now})
	require.NoError(t, err)
	require.Equal(t, Result{Matched: 3, Done: 3, Skipped: 1}, res)
	require.Equal(t, 1, acted)

	// Another number: refused, nothing done, with the count now.
	_, err = Run(ctx, fakeTarget{now: now, recount: 2, count: 5, acted: &acted}, Confirmation{Count: 3, AsOf: now})
	var ce *CountChangedError
	require.ErrorAs(t, err, &ce)
	require.ErrorIs(t, err, ErrCountChanged)
	require.Equal(t, Confirmation{Count: 5, AsOf: now, MaxID: 9}, ce.Now)
	require.Equal(t, 1, acted, "nothing done")
	require.Contains(t, err.Error(), "2 of the 3 rows confirmed (expect) still match; 5 rows match now")

	// An as_of after the store's time: no count gave it.
	_, err = Run(ctx, fakeTarget{now: now, acted: &acted}, Confirmation{AsOf: now.Add(time.Second)})
	require.ErrorIs(t, err, ErrBadConfirmation)
	require.Equal(t, 1, acted)

	// Zero confirmed, zero left: nothing to do.
	res, err = Run(ctx, fakeTarget{now: now, acted: &acted}, Confirmation{AsOf: now})
	require.NoError(t, err)
	require.Equal(t, Result{}, res)
	require.Equal(t, 1, acted)

	// Stopped part-way: what was done, and the cause.
	boom := errors.New("boom")
	_, err = Run(ctx, fakeTarget{now: now, recount: 4, actErr: boom, doneOnFail: 2, acted: &acted}, Confirmation{Count: 4, AsOf: now})
	var se *StoppedError
	require.ErrorAs(t, err, &se)
	require.ErrorIs(t, err, boom)
	require.EqualValues(t, 2, se.Done)
}

func TestConfirmationToken(t *testing.T) {
	at := time.Date(2026, 1, 2, 3, 4, 5, 123456789, time.UTC)
	for _, c := range []Confirmation{{Count: 3, AsOf: at}, {Count: 7, AsOf: at, MaxID: 42}} {
		got, err := ParseToken(c.Token())
		require.NoError(t, err)
		require.Equal(t, c, got)
	}
	for _, bad := range []string{"", "3", "x@2026-01-02T03:04:05Z", "3@yesterday", "3@2026-01-02T03:04:05Z/x"} {
		_, err := ParseToken(bad)
		require.ErrorIs(t, err, ErrBadConfirmation, bad)
	}
	require.NoError(t, Confirmation{Count: 2, AsOf: at, MaxID: 5}.Check(true))
	require.ErrorIs(t, Confirmation{Count: 2, AsOf: at}.Check(true), ErrBadConfirmation, "rows without max_id")
	require.ErrorIs(t, Confirmation{Count: 2, AsOf: at, MaxID: 5}.Check(false), ErrBadConfirmation, "messages with a max_id")
	require.ErrorIs(t, Confirmation{Count: -1, AsOf: at}.Check(false), ErrBadConfirmation)
}

func TestStateWords(t *testing.T) {
	require.Equal(t, "no record", KeyState(""))
	require.Equal(t, "parked", KeyState(KeyParked))
	require.Equal(t, []string{"quarantined", "failing", "all"}, RowStates())
}
