package opstest

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
)

var errNotFound = inbox.ErrNotFound

func requireErrorIs(t *testing.T, err, target error) {
	t.Helper()
	require.ErrorIs(t, err, target)
}

func msg(uuid, topic, payload string) *inboxdb.ParkedMessage {
	return &inboxdb.ParkedMessage{UUID: uuid, Topic: topic, Payload: []byte(payload), PayloadSize: len(payload), Metadata: map[string]string{}}
}

// An action given an Expect acts only while the key is what the operator
// was shown, and otherwise changes nothing and says what the key is now
// (ErrChanged); versions change with what they stand for, and only then.
func testExpect(t *testing.T, h Harness) {
	s, ctx := h.Store, h.Ctx
	h.Park(t, "c", "k", "permanent", msg("u1", "t", "x"))
	m1, err := s.GetParked(ctx, "c", "k")
	require.NoError(t, err)
	r1, err := s.Get(ctx, "c", "k")
	require.NoError(t, err)
	require.NotEmpty(t, m1.Version)
	require.NotEmpty(t, r1.Version)

	// A duplicate is counted in the record: its version stays.
	require.False(t, h.Deliver(t, "c", "k"))
	r, err := s.Get(ctx, "c", "k")
	require.NoError(t, err)
	require.Equal(t, r1.Duplicates+1, r.Duplicates)
	require.Equal(t, r1.Version, r.Version, "counting a duplicate does not change the record's version")

	// Preconditions that do not hold: nothing done.
	err = s.DiscardParked(ctx, "c", "k", inbox.DiscardOptions{Expect: inbox.Expect{MessageUUID: "u0"}})
	require.ErrorIs(t, err, inbox.ErrChanged)
	require.ErrorContains(t, err, "message u1")
	_, err = s.ReplayParked(ctx, "c", "k", inbox.ReplayOptions{Expect: inbox.Expect{Version: "msg-0123456789abcdef"}})
	require.ErrorIs(t, err, inbox.ErrChanged)
	_, err = s.ReplayParked(ctx, "c", "k", inbox.ReplayOptions{Expect: inbox.Expect{Status: "failed"}})
	require.ErrorIs(t, err, inbox.ErrChanged)
	_, err = s.Forget(ctx, "c", "k", inbox.Expect{Status: "done"})
	require.ErrorIs(t, err, inbox.ErrChanged)
	require.ErrorContains(t, err, "now parked")
	_, err = s.Release(ctx, "c", "k", inbox.Expect{MessageUUID: "u0"})
	require.ErrorIs(t, err, inbox.ErrChanged)
	_, err = s.Release(ctx, "c", "k", inbox.Expect{Version: "rec-0123456789abcdef"})
	require.ErrorIs(t, err, inbox.ErrChanged)
	require.Empty(t, h.Replayed(t))
	require.Equal(t, "parked", h.status(t, "c", "k"))
	m, err := s.GetParked(ctx, "c", "k")
	require.NoError(t, err)
	require.Equal(t, m1, m, "untouched")

	// Released: the record's version changes, the message's does not.
	ok, err := s.Release(ctx, "c", "k", inbox.Expect{Version: r1.Version, Status: "parked", MessageUUID: "u1"})
	require.NoError(t, err)
	require.True(t, ok)
	r2, err := s.Get(ctx, "c", "k")
	require.NoError(t, err)
	require.NotEqual(t, r1.Version, r2.Version)
	m, err = s.GetParked(ctx, "c", "k")
	require.NoError(t, err)
	require.Equal(t, m1.Version, m.Version)
	_, err = s.Forget(ctx, "c", "k", inbox.Expect{Version: r1.Version})
	require.ErrorIs(t, err, inbox.ErrChanged, "the record shown parked was released since")

	// Replayed, and the key parked again with another message: the
	// message's version and UUID tell the two apart.
	_, err = s.ReplayParked(ctx, "c", "k", inbox.ReplayOptions{Expect: inbox.Expect{Version: m1.Version, MessageUUID: "u1"}})
	require.NoError(t, err)
	h.Park(t, "c", "k", "permanent", msg("u2", "t", "y"))
	m2, err := s.GetParked(ctx, "c", "k")
	require.NoError(t, err)
	require.NotEqual(t, m1.Version, m2.Version)
	err = s.DiscardParked(ctx, "c", "k", inbox.DiscardOptions{Expect: inbox.Expect{Version: m1.Version}})
	require.ErrorIs(t, err, inbox.ErrChanged)
	require.ErrorContains(t, err, "message u2")
	err = s.DiscardParked(ctx, "c", "k", inbox.DiscardOptions{Forget: true, Expect: inbox.Expect{MessageUUID: "u1"}})
	require.ErrorIs(t, err, inbox.ErrChanged)
	require.Equal(t, "parked", h.status(t, "c", "k"))
	require.NoError(t, s.DiscardParked(ctx, "c", "k", inbox.DiscardOptions{Expect: inbox.Expect{Version: m2.Version}}))
	require.Equal(t, "discarded", h.status(t, "c", "k"))

	// A key without a record: not found, whatever the expectation.
	_, err = s.Forget(ctx, "c", "nope", inbox.Expect{Status: "parked"})
	require.ErrorIs(t, err, inbox.ErrNotFound)
	_, err = s.Release(ctx, "c", "nope", inbox.Expect{Status: "parked"})
	require.ErrorIs(t, err, inbox.ErrNotFound)

	// Bulk actions are bounded by their count, not by an Expect.
	_, err = s.DiscardParkedMatching(ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.DiscardOptions{Expect: inbox.Expect{Version: m2.Version}})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	_, err = s.DiscardParkedMatching(ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.DiscardOptions{All: true, Expect: inbox.Expect{Version: m2.Version}})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	_, err = s.ReplayParkedMatching(ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.ReplayOptions{Expect: inbox.Expect{Version: m2.Version}})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	_, err = s.Forget(ctx, "c", "k", inbox.Expect{Version: "a\x00b"})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	// A version of another kind is refused as such, not taken for a
	// change: a message's for a record, a record's for a message.
	_, err = s.Release(ctx, "c", "k", inbox.Expect{Version: m2.Version})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	require.ErrorContains(t, err, "not the version of a key's record: give the version inbox show")
	r3, err := s.Get(ctx, "c", "k")
	require.NoError(t, err)
	_, err = s.ReplayParked(ctx, "c", "k", inbox.ReplayOptions{Expect: inbox.Expect{Version: r3.Version}})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
}

// GetParkedPrefix reads at most the bytes asked for of the payload, with
// the payload's whole size and the fields of GetParked; a message whose
// payload was not kept has none; FindParked reads no payload by default.
func testGetParkedPrefix(t *testing.T, h Harness) {
	s, ctx := h.Store, h.Ctx
	large := strings.Repeat("0123456789abcdef", 1<<16) // 1 MiB: stored out of line
	lm := msg("u-large", "t", large)
	lm.Metadata = map[string]string{"order_id": "A-1"}
	h.Park(t, "c", "large", "too large", lm)
	h.Park(t, "c", "small", "bad", msg("u-small", "t", `{"n":1}`))
	h.Park(t, "c", "gone", "too large", &inboxdb.ParkedMessage{UUID: "u-gone", Topic: "t", PayloadSize: 300, Metadata: map[string]string{}})
	h.Park(t, "c", "empty", "bad", msg("u-empty", "t", ""))

	m, err := s.GetParkedPrefix(ctx, "c", "large", 10)
	require.NoError(t, err)
	require.Equal(t, "0123456789", string(m.Payload))
	require.Equal(t, len(large), m.PayloadSize)
	require.True(t, m.PayloadKept)
	require.Equal(t, "too large", m.Reason)
	require.Equal(t, "parked", m.Status)
	require.Equal(t, map[string]string{"order_id": "A-1"}, m.Metadata)
	whole, err := s.GetParked(ctx, "c", "large")
	require.NoError(t, err)
	require.Equal(t, large, string(whole.Payload))
	whole.Payload = m.Payload
	require.Equal(t, whole, m, "the fields of GetParked")

	m, err = s.GetParkedPrefix(ctx, "c", "small", 10)
	require.NoError(t, err)
	require.Equal(t, `{"n":1}`, string(m.Payload), "shorter than the bound: whole")

	m, err = s.GetParkedPrefix(ctx, "c", "large", 0)
	require.NoError(t, err)
	require.Empty(t, m.Payload)
	require.True(t, m.PayloadKept)
	require.Equal(t, len(large), m.PayloadSize)

	m, err = s.GetParkedPrefix(ctx, "c", "empty", 10)
	require.NoError(t, err)
	require.Empty(t, m.Payload)
	require.True(t, m.PayloadKept)

	m, err = s.GetParkedPrefix(ctx, "c", "gone", 10)
	require.NoError(t, err)
	require.Nil(t, m.Payload)
	require.False(t, m.PayloadKept)
	require.Equal(t, 300, m.PayloadSize)

	page, err := s.FindParked(ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.Page{})
	require.NoError(t, err)
	require.Len(t, page.Messages, 4)
	for _, m := range page.Messages {
		require.Nil(t, m.Payload, "a page reads no payload")
	}

	_, err = s.GetParkedPrefix(ctx, "c", "large", -1)
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	_, err = s.GetParkedPrefix(ctx, "c", "nope", 10)
	require.ErrorIs(t, err, inbox.ErrNotParked)
}

// A message whose UUID or metadata had to be changed to be stored is kept
// for reading, never replayed: with an empty payload it must not read back
// as kept either (an empty payload once counted as kept whatever else). An
// unchanged empty payload is kept, and replayed empty.
func testChangedMessageWithEmptyPayload(t *testing.T, h Harness) {
	s, ctx := h.Store, h.Ctx
	changed := []*inboxdb.ParkedMessage{
		{UUID: "u-\xff1", Topic: "orders.in", Payload: []byte{}, Metadata: map[string]string{"order_id": "A-1", "sig": "ab\xffcd"}},
		{UUID: "u-1", Topic: "orders.in", Payload: []byte{}, Metadata: map[string]string{"sig": "ab\xffcd"}},
	}
	for i, m := range changed {
		h.Park(t, "c", "changed-"+string(rune('a'+i)), "declined", m)
	}
	h.Park(t, "c", "empty", "declined", &inboxdb.ParkedMessage{UUID: "u-2", Topic: "orders.in", Payload: []byte{}, Metadata: map[string]string{"sig": "abcd"}})

	for _, key := range []string{"changed-a", "changed-b"} {
		m, err := s.GetParked(ctx, "c", key)
		require.NoError(t, err)
		require.False(t, m.PayloadKept, "%s: a changed message reads back as not kept", key)
		page, err := s.FindParked(ctx, inbox.ParkedFilter{Consumer: "c", Key: key}, inbox.Page{})
		require.NoError(t, err)
		require.Len(t, page.Messages, 1)
		require.False(t, page.Messages[0].PayloadKept)
		_, err = s.ReplayParked(ctx, "c", key, inbox.ReplayOptions{})
		require.ErrorIs(t, err, inbox.ErrNotReplayable)
	}
	require.Empty(t, h.Replayed(t))

	m, err := s.GetParked(ctx, "c", "empty")
	require.NoError(t, err)
	require.True(t, m.PayloadKept, "an unchanged empty payload is kept")
	_, err = s.ReplayParked(ctx, "c", "empty", inbox.ReplayOptions{})
	require.NoError(t, err)
	sent := h.Replayed(t)
	require.Len(t, sent, 1, "only the unchanged message is replayed")
	require.Equal(t, "u-2", sent[0].UUID)
	require.Empty(t, sent[0].Payload)
	require.Equal(t, map[string]string{"sig": "abcd"}, sent[0].Metadata)
}

// Discarding with Forget deletes a key's record only while it waits for an
// operator: a released key whose redelivery was processed since is done,
// and a late copy must stay a duplicate, discarded one by one or in bulk
// (by reason, or by key).
func testDiscardForgetKeepsADoneRecord(t *testing.T, h Harness) {
	s, ctx := h.Store, h.Ctx
	for _, how := range []string{"one", "bulk-reason", "bulk-key"} {
		key := "released-" + how
		h.Park(t, "c", key, "card declined", msg("u-"+key, "orders.in", "p"))
		ok, err := s.Release(ctx, "c", key, inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok)
		require.True(t, h.Deliver(t, "c", key), "the redelivery runs once")
		require.Equal(t, "done", h.status(t, "c", key))
		switch how {
		case "one":
			require.NoError(t, s.DiscardParked(ctx, "c", key, inbox.DiscardOptions{Forget: true}))
		default:
			f := inbox.ParkedFilter{Consumer: "c", Reason: "card declined"}
			if how == "bulk-key" {
				f = inbox.ParkedFilter{Consumer: "c", Key: key}
			}
			n, err := s.DiscardParkedMatching(ctx, f, inbox.DiscardOptions{Forget: true})
			require.NoError(t, err)
			require.EqualValues(t, 1, n)
		}
		_, err = s.GetParked(ctx, "c", key)
		require.ErrorIs(t, err, inbox.ErrNotParked, "the parked message is discarded")
		require.Equal(t, "done", h.status(t, "c", key), "%s: the done record stays", how)
		require.False(t, h.Deliver(t, "c", key), "%s: a late copy is a duplicate", how)
	}
	// A record still parked is forgotten: its next delivery runs.
	h.Park(t, "c", "still-parked", "card declined", msg("u-still", "orders.in", "p"))
	require.NoError(t, s.DiscardParked(ctx, "c", "still-parked", inbox.DiscardOptions{Forget: true}))
	require.Equal(t, "", h.status(t, "c", "still-parked"))
	require.True(t, h.Deliver(t, "c", "still-parked"))
}
