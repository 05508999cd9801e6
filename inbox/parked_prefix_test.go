package inbox_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
)

// GetParkedPrefix reads at most the first bytes of a parked message's
// payload (all of it when shorter, none with 0) and the whole size; a
// message whose payload was not kept has none; FindParked reads no
// payload by default.
func TestGetParkedPrefix(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, b bundle) {
		large := strings.Repeat("0123456789abcdef", 1<<16) // 1 MiB: stored out of line
		b.seed(t, parkedMsg{consumer: "c", key: "large", topic: "t", payload: []byte(large), reason: "too large"})
		b.seed(t, parkedMsg{consumer: "c", key: "small", topic: "t", payload: []byte(`{"n":1}`), reason: "bad"})
		b.seed(t, parkedMsg{consumer: "c", key: "gone", topic: "t", payload: make([]byte, 300), notKept: true, reason: "too large"})

		m, err := b.store.GetParkedPrefix(b.ctx, "c", "large", 10)
		require.NoError(t, err)
		require.Equal(t, "0123456789", string(m.Payload))
		require.Equal(t, len(large), m.PayloadSize)
		require.True(t, m.PayloadKept)
		require.Equal(t, "too large", m.Reason)
		require.Equal(t, "parked", m.Status)

		m, err = b.store.GetParkedPrefix(b.ctx, "c", "small", 10)
		require.NoError(t, err)
		require.Equal(t, `{"n":1}`, string(m.Payload), "shorter than the bound: whole")

		m, err = b.store.GetParkedPrefix(b.ctx, "c", "large", 0)
		require.NoError(t, err)
		require.Empty(t, m.Payload)
		require.True(t, m.PayloadKept)
		require.Equal(t, len(large), m.PayloadSize)

		m, err = b.store.GetParkedPrefix(b.ctx, "c", "gone", 10)
		require.NoError(t, err)
		require.Nil(t, m.Payload)
		require.False(t, m.PayloadKept)
		require.Equal(t, 300, m.PayloadSize)

		whole, err := b.store.GetParked(b.ctx, "c", "large")
		require.NoError(t, err)
		require.Equal(t, large, string(whole.Payload))

		page, err := b.store.FindParked(b.ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.Page{})
		require.NoError(t, err)
		require.Len(t, page.Messages, 3)
		for _, m := range page.Messages {
			require.Nil(t, m.Payload, "a page reads no payload")
		}

		_, err = b.store.GetParkedPrefix(b.ctx, "c", "large", -1)
		require.ErrorIs(t, err, inbox.ErrInvalidFilter)
		_, err = b.store.GetParkedPrefix(b.ctx, "c", "nope", 10)
		require.ErrorIs(t, err, inbox.ErrNotParked)
	})
}
