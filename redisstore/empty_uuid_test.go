package redisstore_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// A message with an empty UUID (a producer that set none; the key comes
// from its metadata) is parked with it, as the PostgreSQL store parks and
// lists it. The Redis store's scripts treat the record as holding a
// message (m_uuid is present), but its reads took an empty m_uuid for no
// message: the message was never listed or counted, GetParked said not
// parked, so the console could not show it or discard it with what it
// showed; and once released, the record stayed in the parked set without
// expiring (the prune keeps it: it has a message), read by every scan.
// It must be found, shown and discarded with its version like any other.
func TestRedisParkedMessageWithEmptyUUID(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	b.parkWith(t, "c", "k", "declined", &inboxdb.ParkedMessage{UUID: "", Topic: "t", Payload: []byte("p"), Metadata: map[string]string{"order_id": "A-1"}})

	require.True(t, b.c.HExists(b.ctx, b.rec("c", "k"), "m_uuid").Val(), "kept, with its empty UUID")

	n, err := b.s.CountParked(b.ctx, inbox.ParkedFilter{Consumer: "c"})
	require.NoError(t, err)
	require.EqualValues(t, 1, n, "listed, as the PostgreSQL store lists it")
	m, err := b.s.GetParked(b.ctx, "c", "k")
	require.NoError(t, err)
	require.Equal(t, "", m.UUID)
	require.Equal(t, "parked", m.Status)
	require.NoError(t, b.s.DiscardParked(b.ctx, "c", "k", inbox.DiscardOptions{Expect: inbox.Expect{Version: m.Version}}))
	require.Equal(t, "discarded", b.status(t, "c", "k"))
	require.False(t, b.inSet(t, "c", "k"))
}
