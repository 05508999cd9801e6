package opstest

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
)

// A replay publishes the parked message as it was kept (its UUID, topic,
// payload and metadata), releases the key and deletes the message; the
// copy runs once, and a late redelivery is a duplicate.
func testReplayParked(t *testing.T, h Harness) {
	s, ctx := h.Store, h.Ctx
	meta := map[string]string{"order_id": "A-1042", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "empty": ""}
	h.Park(t, "orders", "k1", "bad address", &inboxdb.ParkedMessage{UUID: "018f-uuid-1", Topic: "orders.in", Payload: []byte(`{"order":"A-1042"}`),
		PayloadSize: 18, Metadata: meta})

	found, err := s.FindParked(ctx, inbox.ParkedFilter{Consumer: "orders", Metadata: map[string]string{"order_id": "A-1042"}}, inbox.Page{})
	require.NoError(t, err)
	require.Len(t, found.Messages, 1)
	m, err := s.ReplayParked(ctx, found.Messages[0].Consumer, found.Messages[0].Key, inbox.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, "orders.in", m.Topic)
	require.Equal(t, "parked", m.Status, "the status before the replay")
	require.Equal(t, "bad address", m.Reason)

	// The original message is published for its topic; the key is
	// released; the parked message is gone.
	require.Equal(t, []Replayed{{Topic: "orders.in", UUID: "018f-uuid-1", Payload: []byte(`{"order":"A-1042"}`), Metadata: meta}}, h.Replayed(t))
	require.Equal(t, "failed", h.status(t, "orders", "k1"))
	_, err = s.GetParked(ctx, "orders", "k1")
	require.ErrorIs(t, err, inbox.ErrNotParked)

	// A second replay finds nothing; nothing changes.
	_, err = s.ReplayParked(ctx, "orders", "k1", inbox.ReplayOptions{})
	require.ErrorIs(t, err, inbox.ErrNotParked)
	require.Len(t, h.Replayed(t), 1)

	// The replayed copy runs once (the key was released); a late
	// redelivery of the original, or of the copy, is a duplicate.
	require.True(t, h.Deliver(t, "orders", "k1"), "the replayed message runs")
	require.False(t, h.Deliver(t, "orders", "k1"), "a late redelivery is a duplicate")
	require.Equal(t, "done", h.status(t, "orders", "k1"))
}

// A message that cannot be replayed as it is is refused, nothing changed,
// saying why; a topic given by the operator replays one without its own;
// a released key's message and an empty payload are replayed.
func testReplayParkedRefusals(t *testing.T, h Harness) {
	s, ctx := h.Store, h.Ctx
	h.Park(t, "c", "big", "permanent", &inboxdb.ParkedMessage{UUID: "u-big", Topic: "t", PayloadSize: 10, Metadata: map[string]string{}})
	h.Park(t, "c", "notopic", "permanent", msg("u-notopic", "", "x"))
	h.Park(t, "c", "done", "permanent", msg("u-done", "t", "x"))
	h.SetStatus(t, "c", "done", "done")
	h.Park(t, "c", "busy", "permanent", msg("u-busy", "t", "x"))
	h.SetStatus(t, "c", "busy", "processing")

	for key, want := range map[string]string{
		"big":     "payload (10 bytes) was over the size the middleware keeps",
		"notopic": "ReplayOptions.Topic",
		"done":    "discard it",
		"busy":    "being processed",
	} {
		before := h.status(t, "c", key)
		_, err := s.ReplayParked(ctx, "c", key, inbox.ReplayOptions{})
		require.ErrorIs(t, err, inbox.ErrNotReplayable, key)
		require.ErrorContains(t, err, want)
		require.Equal(t, before, h.status(t, "c", key), "nothing changed: %s", key)
		_, err = s.GetParked(ctx, "c", key)
		require.NoError(t, err, "the parked message stays: %s", key)
	}
	require.Empty(t, h.Replayed(t))

	// A topic given by the operator: the message without one is replayed
	// there (and a topic override wins over the stored one).
	m, err := s.ReplayParked(ctx, "c", "notopic", inbox.ReplayOptions{Topic: "elsewhere"})
	require.NoError(t, err)
	require.Equal(t, "elsewhere", m.Topic)
	require.Equal(t, "elsewhere", h.Replayed(t)[0].Topic)
	require.Equal(t, "failed", h.status(t, "c", "notopic"))

	// A key released before (Release keeps the message) is replayed too:
	// only published.
	h.Park(t, "c", "released", "permanent", msg("u-released", "t", "r"))
	ok, err := s.Release(ctx, "c", "released", inbox.Expect{})
	require.NoError(t, err)
	require.True(t, ok)
	m, err = s.ReplayParked(ctx, "c", "released", inbox.ReplayOptions{Topic: "over"})
	require.NoError(t, err)
	require.Equal(t, "over", m.Topic)
	require.Equal(t, "failed", m.Status)
	require.Equal(t, "failed", h.status(t, "c", "released"))
	require.Len(t, h.Replayed(t), 2)

	// An empty payload is kept (size 0) and replayed as empty.
	h.Park(t, "c", "empty", "permanent", msg("u-empty", "t", ""))
	_, err = s.ReplayParked(ctx, "c", "empty", inbox.ReplayOptions{})
	require.NoError(t, err)
	sent := h.Replayed(t)
	require.Len(t, sent, 3)
	require.Empty(t, sent[2].Payload)
}

// A discard deletes the parked message: the key becomes discarded (not
// listed or counted as parked, a late redelivery a duplicate), or with
// Forget loses its record (the next delivery runs); by filter too, an
// empty filter only with All. Forget takes the message with the record.
func testDiscardParked(t *testing.T, h Harness) {
	s, ctx := h.Store, h.Ctx
	h.Park(t, "c", "keep", "permanent", msg("u-keep", "t", "x"))
	h.Park(t, "c", "forget", "permanent", msg("u-forget", "t", "x"))

	require.NoError(t, s.DiscardParked(ctx, "c", "keep", inbox.DiscardOptions{}))
	_, err := s.GetParked(ctx, "c", "keep")
	require.ErrorIs(t, err, inbox.ErrNotParked)
	require.Equal(t, "discarded", h.status(t, "c", "keep"), "the key is no longer parked: discarded")
	keys, err := s.Parked(ctx, "c", 10)
	require.NoError(t, err)
	require.Len(t, keys, 1, "only the other key is listed as parked")
	require.Equal(t, "forget", keys[0].Key)
	require.False(t, h.Deliver(t, "c", "keep"), "a late redelivery of a discarded message does not run")
	rec, err := s.Get(ctx, "c", "keep")
	require.NoError(t, err)
	require.Equal(t, "discarded", rec.Status)
	require.Equal(t, int64(1), rec.Duplicates, "counted as a duplicate")
	require.ErrorIs(t, s.DiscardParked(ctx, "c", "keep", inbox.DiscardOptions{}), inbox.ErrNotParked, "discarded once")

	// Discarded and forgotten: the next delivery runs.
	require.NoError(t, s.DiscardParked(ctx, "c", "forget", inbox.DiscardOptions{Forget: true}))
	require.Equal(t, "", h.status(t, "c", "forget"))
	require.ErrorIs(t, s.DiscardParked(ctx, "c", "forget", inbox.DiscardOptions{Forget: true}), inbox.ErrNotParked)
	require.True(t, h.Deliver(t, "c", "forget"), "forgotten: the next delivery runs")

	// By filter.
	for i := range 12 {
		h.Park(t, "c", fmt.Sprint("bulk", i), "Schema mismatch", msg(fmt.Sprint("u-bulk", i), "t", "x"))
	}
	// An empty filter is refused (without All; the Redis store wants a
	// consumer always, and All with the consumer alone).
	_, err = s.DiscardParkedMatching(ctx, inbox.ParkedFilter{}, inbox.DiscardOptions{})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	n, err := s.DiscardParkedMatching(ctx, inbox.ParkedFilter{Consumer: "c", Reason: "schema"}, inbox.DiscardOptions{})
	require.NoError(t, err)
	require.Equal(t, int64(12), n)
	require.Equal(t, "discarded", h.status(t, "c", "bulk3"), "no longer parked")
	h.Park(t, "c", "last", "permanent", msg("u-last", "t", "x"))
	n, err = s.DiscardParkedMatching(ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.DiscardOptions{All: true, Forget: true})
	require.NoError(t, err)
	require.Equal(t, int64(1), n)
	require.Equal(t, "", h.status(t, "c", "last"))

	// Forget takes the message with the record.
	h.Park(t, "c", "f2", "permanent", msg("u-f2", "t", "x"))
	ok, err := s.Forget(ctx, "c", "f2", inbox.Expect{})
	require.NoError(t, err)
	require.True(t, ok)
	_, err = s.GetParked(ctx, "c", "f2")
	require.ErrorIs(t, err, inbox.ErrNotParked)
	require.Empty(t, h.Replayed(t))
}

// A bulk replay replays every match, oldest parked first, in batches,
// skipping (and counting) the messages that cannot be replayed, which stay
// parked; a message outside the filter stays; a second run replays
// nothing again; a cancelled context stops it.
func testReplayParkedMatching(t *testing.T, h Harness) {
	s, ctx := h.Store, h.Ctx
	const n = 230
	for i := range n {
		m := &inboxdb.ParkedMessage{UUID: fmt.Sprintf("uuid-k%03d", i), Topic: "t", Payload: []byte(fmt.Sprint(i)),
			Metadata: map[string]string{"campaign": "spring"}}
		m.PayloadSize = len(m.Payload)
		if i%50 == 7 {
			m.Payload = nil // not kept
		}
		h.Park(t, "c", fmt.Sprintf("k%03d", i), "downstream 503", m)
	}
	other := msg("uuid-other", "t", "o")
	other.Metadata = map[string]string{"campaign": "fall"}
	h.Park(t, "c", "other", "downstream 503", other)
	f := inbox.ParkedFilter{Consumer: "c", Metadata: map[string]string{"campaign": "spring"}}
	c, err := s.CountParked(ctx, f)
	require.NoError(t, err)
	require.Equal(t, int64(n), c)

	rep, err := s.ReplayParkedMatching(ctx, f, inbox.ReplayOptions{BatchSize: 100})
	require.NoError(t, err)
	require.Equal(t, inbox.ReplayReport{Replayed: 225, Skipped: 5}, rep)
	sent := h.Replayed(t)
	require.Len(t, sent, 225)
	require.Equal(t, "uuid-k000", sent[0].UUID, "oldest parked first")
	c, err = s.CountParked(ctx, f)
	require.NoError(t, err)
	require.Equal(t, int64(5), c, "the ones not kept stay")
	for i := range n {
		want := "failed" // replayed: released
		if i%50 == 7 {
			want = "parked" // not kept: not replayed
		}
		require.Equal(t, want, h.status(t, "c", fmt.Sprintf("k%03d", i)))
	}
	require.Equal(t, "parked", h.status(t, "c", "other"), "outside the filter")

	rep, err = s.ReplayParkedMatching(ctx, f, inbox.ReplayOptions{})
	require.NoError(t, err)
	require.Equal(t, inbox.ReplayReport{Skipped: 5}, rep, "a second run replays nothing again")

	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err = s.ReplayParkedMatching(cctx, inbox.ParkedFilter{Consumer: "c"}, inbox.ReplayOptions{All: true})
	require.ErrorIs(t, err, context.Canceled)
}
