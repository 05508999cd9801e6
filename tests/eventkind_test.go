package tests

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// TestEventKindMatchesCounters: testenv.EventKind (the chaos suite's event
// names) puts every event in the Counters field of the same name, so that
// the chaos report and the tests' counters never disagree.
func TestEventKindMatchesCounters(t *testing.T) {
	t.Parallel()
	wrap := func(err error) error { return fmt.Errorf("exactlyonce: k for c: %w", err) }
	events := map[string]exactlyonce.Event{
		"processed":                  {Outcome: exactlyonce.Processed},
		"duplicate":                  {Outcome: exactlyonce.Duplicate},
		"parked":                     {Outcome: exactlyonce.Parked, Err: errors.New("reason")},
		"fail_open":                  {Outcome: exactlyonce.FailOpen},
		"rejected":                   {Outcome: exactlyonce.Nacked, Err: wrap(exactlyonce.ErrInvalidKey)},
		"db_unavailable":             {Outcome: exactlyonce.Nacked, Err: wrap(exactlyonce.ErrDBUnavailable)},
		"failed (completion outage)": {Outcome: exactlyonce.Nacked, Err: wrap(exactlyonce.ErrDBUnavailable), Attempt: 1},
		"claim_failed":               {Outcome: exactlyonce.Nacked, Err: wrap(exactlyonce.ErrClaimFailed)},
		"busy":                       {Outcome: exactlyonce.Nacked, Err: wrap(exactlyonce.ErrLeaseHeld)},
		"failed (handler)":           {Outcome: exactlyonce.Nacked, Err: errors.New("handler failed")},
		"failed (lease lost)":        {Outcome: exactlyonce.Nacked, Err: wrap(exactlyonce.ErrLeaseLost), Attempt: 2},
		"unknown":                    {},
	}
	for name, ev := range events {
		var c testenv.Counters
		c.Observe(ev)
		counted := map[string]int64{
			"processed": c.Processed.Load(), "duplicate": c.Duplicates.Load(), "parked": c.Parked.Load(),
			"fail_open": c.FailOpen.Load(), "rejected": c.Rejected.Load(), "db_unavailable": c.DBUnavailable.Load(),
			"claim_failed": c.ClaimFailed.Load(), "busy": c.Busy.Load(), "failed": c.Failed.Load(),
		}
		kind := testenv.EventKind(ev)
		require.True(t, strings.HasPrefix(name, kind), "%s: EventKind says %q", name, kind)
		for field, n := range counted {
			if field == kind {
				require.Equal(t, int64(1), n, "%s: EventKind says %q, Counters must count it there", name, kind)
			} else {
				require.Zero(t, n, "%s: EventKind says %q, Counters counted it as %q", name, kind, field)
			}
		}
	}
}
