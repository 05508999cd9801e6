package console

import (
	"context"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
)

// releaser is what both stores offer to release a key (the CLI's parked
// release: a second operator).
type releaser interface {
	Release(ctx context.Context, consumer, key string, expect inbox.Expect) (bool, error)
}

// A discard that keeps the key promises, on its confirmation, that the
// key "stays recorded, as discarded, so a late redelivery is still not
// run". That holds for the status the confirmation showed (parked): if a
// second operator releases the key between the confirmation and the
// confirm (the message stays kept, listed, with the same version), the
// discard would leave the key failed, and its late redelivery would run
// the handler, which the confirmation said it would not. The confirm must
// act on the status it showed, or refuse (409 changed), nothing done.
//
// And a key already released when the confirmation is made must not be
// promised what its discard will not do.
func TestConfirmedDiscardActsOnTheStatusItShowed(t *testing.T) {
	t.Parallel()
	for name, setup := range preStores(t) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			e, s := setup(t)
			rel, ok := s.store.(releaser)
			require.True(t, ok)
			s.park(t, "k", "u1")
			msgPage := "/eo/parked/" + preConsumer + "/k" + s.q
			action, v := form(t, page(t, e.get(msgPage), http.StatusOK), "discard-form")
			body := page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusOK)
			require.Contains(t, body, "as discarded, so a late redelivery is still not run")
			action, v = form(t, body, "confirm-form")

			released, err := rel.Release(e.ctx, preConsumer, "k", inbox.Expect{})
			require.NoError(t, err)
			require.True(t, released)

			body = page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusConflict)
			require.Contains(t, text(t, body, "result"), "failed", "the page says what the key is now")
			require.Equal(t, "u1", s.parkedNow(t, e, "k"), "nothing done: the message stays")
			require.Equal(t, "failed", s.statusNow(t, e, "k"))

			// Looked at again (released), the confirmation promises no
			// duplicate drop, and the discard acts.
			action, v = form(t, page(t, e.get(msgPage), http.StatusOK), "discard-form")
			body = page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusOK)
			require.NotContains(t, body, "a late redelivery is still not run", "a released key's delivery runs")
			action, v = form(t, body, "confirm-form")
			page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusOK)
			require.Empty(t, s.parkedNow(t, e, "k"))
			require.Equal(t, "failed", s.statusNow(t, e, "k"))
		})
	}
}
