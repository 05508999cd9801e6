package inbox_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
)

// FindParked and CountParked of a filter that Scans refuse, with
// ErrTooBroad, when its indexed conditions select more than MaxScan
// messages, and answer as without the bound otherwise; CountParked
// refuses a count over MaxCount. The bulk operations ignore the bounds.
func TestParkedReadsBounded(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, b bundle) {
		for _, k := range []string{"acme:1", "acme:2", "acme:3", "globex:4"} {
			b.seed(t, parkedMsg{consumer: "big", key: k, topic: "t", payload: []byte("x"), reason: "Card declined",
				meta: map[string]string{"order_id": "O-" + k}})
		}
		b.seed(t, parkedMsg{consumer: "small", key: "acme:9", topic: "t", payload: []byte("x"), reason: "card declined"})

		for _, f := range []inbox.ParkedFilter{
			{Reason: "card"},
			{Consumer: "big", Reason: "card"},
			{Tenant: "acme"},
			{Key: "acme:1"},
			{Tenant: "acme", Reason: "card"},
		} {
			require.True(t, f.Scans(), "%+v", f)
			f.MaxScan = 3
			_, err := b.store.FindParked(b.ctx, f, inbox.Page{})
			require.ErrorIs(t, err, inbox.ErrTooBroad, "%+v", f)
			require.ErrorContains(t, err, "more than 3 parked messages")
			_, err = b.store.CountParked(b.ctx, f)
			require.ErrorIs(t, err, inbox.ErrTooBroad, "%+v", f)
		}

		// Within the bound: the same answers as without it.
		for _, c := range []struct {
			f    inbox.ParkedFilter
			want []string
		}{
			{inbox.ParkedFilter{Consumer: "small", Reason: "CARD"}, []string{"small/acme:9"}},
			{inbox.ParkedFilter{Reason: "card", Metadata: map[string]string{"order_id": "O-acme:2"}}, []string{"big/acme:2"}},
			{inbox.ParkedFilter{Consumer: "big", Tenant: "acme"}, []string{"big/acme:1", "big/acme:2", "big/acme:3"}},
			{inbox.ParkedFilter{Consumer: "big", Key: "acme:2", Reason: "card"}, []string{"big/acme:2"}},
			{inbox.ParkedFilter{Consumer: "big"}, []string{"big/acme:1", "big/acme:2", "big/acme:3", "big/globex:4"}},
		} {
			unbounded, err := b.store.FindParked(b.ctx, c.f, inbox.Page{})
			require.NoError(t, err)
			require.ElementsMatch(t, c.want, keysOf(unbounded.Messages), "%+v", c.f)
			f := c.f
			f.MaxScan = 3
			bounded, err := b.store.FindParked(b.ctx, f, inbox.Page{})
			require.NoError(t, err, "%+v", f)
			require.Equal(t, keysOf(unbounded.Messages), keysOf(bounded.Messages), "%+v", f)
			n, err := b.store.CountParked(b.ctx, f)
			require.NoError(t, err)
			require.EqualValues(t, len(c.want), n, "%+v", f)
		}

		n, err := b.store.CountParked(b.ctx, inbox.ParkedFilter{Consumer: "big", MaxCount: 4})
		require.NoError(t, err)
		require.EqualValues(t, 4, n)
		_, err = b.store.CountParked(b.ctx, inbox.ParkedFilter{MaxCount: 4})
		require.ErrorIs(t, err, inbox.ErrTooBroad)
		require.ErrorContains(t, err, "more than 4 parked messages match")
		_, err = b.store.CountParked(b.ctx, inbox.ParkedFilter{MaxScan: -1})
		require.ErrorIs(t, err, inbox.ErrInvalidFilter)

		// A bulk operation acts on every match, whatever the bounds.
		d, err := b.store.DiscardParkedMatching(b.ctx, inbox.ParkedFilter{Reason: "card", MaxScan: 1, MaxCount: 1}, inbox.DiscardOptions{})
		require.NoError(t, err)
		require.EqualValues(t, 5, d)
	})
}
