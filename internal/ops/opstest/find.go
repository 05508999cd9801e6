package opstest

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
)

// FindParked finds a consumer's parked messages by each criterion, oldest
// parked first, CountParked counting what it finds; pages carry payloads
// when asked; a message shows its fields and its key's status now.
func testFindParked(t *testing.T, h Harness) {
	s, ctx := h.Store, h.Ctx
	park := func(consumer, key, uuid, payload string, kept bool, meta map[string]string, reason string, ago time.Duration) {
		t.Helper()
		if uuid == "" {
			uuid = "uuid-" + key
		}
		m := &inboxdb.ParkedMessage{UUID: uuid, Topic: consumer + ".in", Payload: []byte(payload), PayloadSize: len(payload), Metadata: meta}
		if !kept {
			m.Payload = nil
		}
		if m.Metadata == nil {
			m.Metadata = map[string]string{}
		}
		h.Park(t, consumer, key, reason, m)
		h.Age(t, consumer, key, ago)
	}
	park("orders", "acme:1", "", `{"n":1}`, true, map[string]string{"order_id": "A-1", "source": "web"}, "Bad address", 50*time.Minute)
	park("orders", "acme:2", "", `{"n":2}`, true, map[string]string{"order_id": "A-2", "source": "web"}, "card declined", 40*time.Minute)
	park("orders", "globex:3", "u-3", "three", true, map[string]string{"order_id": "G-3", "source": "api"}, "bad ADDRESS line", 30*time.Minute)
	park("orders", "big", "", "0123456789", false, nil, "too big", 20*time.Minute)
	park("invoices", "acme:1", "", "inv", true, map[string]string{"order_id": "A-1"}, "timeout", 10*time.Minute)

	find := func(f inbox.ParkedFilter) []string {
		t.Helper()
		page, err := s.FindParked(ctx, f, inbox.Page{})
		require.NoError(t, err)
		require.Empty(t, page.Next)
		n, err := s.CountParked(ctx, f)
		require.NoError(t, err)
		require.Equal(t, int64(len(page.Messages)), n, "CountParked agrees with FindParked")
		out := []string{}
		for _, m := range page.Messages {
			out = append(out, m.Key)
		}
		return out
	}
	all := []string{"acme:1", "acme:2", "globex:3", "big"}
	require.Equal(t, all, find(inbox.ParkedFilter{Consumer: "orders"}), "oldest parked first")
	require.Empty(t, find(inbox.ParkedFilter{Consumer: "nobody"}), "an unknown consumer matches nothing")
	require.Equal(t, []string{"acme:2"}, find(inbox.ParkedFilter{Consumer: "orders", Key: "acme:2"}))
	require.Equal(t, []string{"globex:3"}, find(inbox.ParkedFilter{Consumer: "orders", MessageUUID: "u-3"}))
	require.Equal(t, []string{"acme:1", "acme:2"}, find(inbox.ParkedFilter{Consumer: "orders", Tenant: "acme"}))
	require.Empty(t, find(inbox.ParkedFilter{Consumer: "orders", Tenant: "acm"}), "a tenant is a whole prefix, up to ':'")
	require.Equal(t, []string{"acme:1", "globex:3"}, find(inbox.ParkedFilter{Consumer: "orders", Reason: "BAD address"}), "any case")
	require.Equal(t, []string{"acme:2"}, find(inbox.ParkedFilter{Consumer: "orders", Reason: "DECLINED"}))
	require.Equal(t, []string{"acme:2", "globex:3"}, find(inbox.ParkedFilter{Consumer: "orders",
		Since: time.Now().Add(-45 * time.Minute), Before: time.Now().Add(-25 * time.Minute)}))
	require.Equal(t, []string{"big"}, find(inbox.ParkedFilter{Consumer: "orders", Since: time.Now().Add(-25 * time.Minute)}))
	require.Equal(t, []string{"acme:1"}, find(inbox.ParkedFilter{Consumer: "orders", Metadata: map[string]string{"order_id": "A-1"}}))
	require.Equal(t, []string{"acme:1", "acme:2"}, find(inbox.ParkedFilter{Consumer: "orders", Metadata: map[string]string{"source": "web"}}))
	require.Empty(t, find(inbox.ParkedFilter{Consumer: "orders", Metadata: map[string]string{"source": "web", "order_id": "G-3"}}))
	require.Empty(t, find(inbox.ParkedFilter{Consumer: "orders", Metadata: map[string]string{"order_id": "A"}}), "exact values, not prefixes")
	require.Equal(t, []string{"acme:1"}, find(inbox.ParkedFilter{Consumer: "invoices", Metadata: map[string]string{"order_id": "A-1"}}))
	require.Equal(t, []string{"globex:3"}, find(inbox.ParkedFilter{Consumer: "orders", Tenant: "globex", Reason: "address",
		Metadata: map[string]string{"source": "api"}}))

	// Pages, with payloads when asked.
	var keys []string
	p := inbox.Page{Limit: 3, Payloads: true}
	var pages int
	for {
		page, err := s.FindParked(ctx, inbox.ParkedFilter{Consumer: "orders"}, p)
		require.NoError(t, err)
		pages++
		for _, m := range page.Messages {
			keys = append(keys, m.Key)
			if m.PayloadKept {
				require.NotNil(t, m.Payload, m.Key)
			} else {
				require.Nil(t, m.Payload, m.Key)
			}
		}
		if page.Next == "" {
			break
		}
		p.After = page.Next
	}
	require.Equal(t, all, keys)
	require.Equal(t, 2, pages)

	// What a message shows: without its payload in a page unless asked.
	page, err := s.FindParked(ctx, inbox.ParkedFilter{Consumer: "orders", Key: "acme:1"}, inbox.Page{})
	require.NoError(t, err)
	require.Len(t, page.Messages, 1)
	require.Nil(t, page.Messages[0].Payload)
	m, err := s.GetParked(ctx, "orders", "acme:1")
	require.NoError(t, err)
	require.Equal(t, inbox.ParkedMessage{Consumer: "orders", Key: "acme:1", UUID: "uuid-acme:1", Topic: "orders.in",
		Payload: []byte(`{"n":1}`), PayloadSize: 7, PayloadKept: true, Metadata: map[string]string{"order_id": "A-1", "source": "web"},
		Reason: "Bad address", Attempts: 1, FirstSeenAt: m.FirstSeenAt, ParkedAt: m.ParkedAt, Status: "parked", Version: m.Version}, m)
	require.NotEmpty(t, m.Version)
	require.WithinDuration(t, time.Now().Add(-50*time.Minute), m.ParkedAt, time.Minute)
	page.Messages[0].Payload = m.Payload
	require.Equal(t, m, page.Messages[0], "a page's message is GetParked's, without its payload")
	m, err = s.GetParked(ctx, "orders", "big")
	require.NoError(t, err)
	require.False(t, m.PayloadKept)
	require.Nil(t, m.Payload)
	require.Equal(t, 10, m.PayloadSize)
	_, err = s.GetParked(ctx, "orders", "nope")
	require.ErrorIs(t, err, inbox.ErrNotParked)
	require.ErrorContains(t, err, `"nope"`)

	// Release keeps the message, listed with the key's status.
	ok, err := s.Release(ctx, "orders", "acme:2", inbox.Expect{})
	require.NoError(t, err)
	require.True(t, ok)
	page, err = s.FindParked(ctx, inbox.ParkedFilter{Consumer: "orders", Key: "acme:2"}, inbox.Page{})
	require.NoError(t, err)
	require.Len(t, page.Messages, 1)
	require.Equal(t, "failed", page.Messages[0].Status)

	// Requests that cannot be run.
	_, err = s.FindParked(ctx, inbox.ParkedFilter{Consumer: "orders", Tenant: "a:b"}, inbox.Page{})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	require.ErrorContains(t, err, "ParkedFilter.Tenant")
	_, err = s.FindParked(ctx, inbox.ParkedFilter{Consumer: "orders"}, inbox.Page{After: "x"})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	require.ErrorContains(t, err, "Page.After")
}
