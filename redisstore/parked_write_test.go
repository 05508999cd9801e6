package redisstore_test

// Every park keeps the message it parked in the key's record, in the
// script that parks: Fail (permanent), ParkInterrupted and the claim that
// parks; a key that was not parked keeps nothing; Forget deletes it.

import (
	"context"
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

func TestParksKeepTheMessage(t *testing.T) {
	t.Parallel()
	s, c, prefix := newStore(t, redisstore.Config{})
	b := leasestore.BackendOf(s)
	ctx := context.Background()
	fields := func(key string) map[string]string {
		t.Helper()
		m, err := c.HGetAll(ctx, prefix+"{c}:k:"+key).Result()
		require.NoError(t, err)
		return m
	}
	claim := func(key string, opts leasestore.Options) leasestore.Attempt {
		t.Helper()
		opts.Lease = time.Minute
		cl, err := b.Claim(ctx, "c", key, opts)
		require.NoError(t, err)
		require.Equal(t, leasestore.Acquired, cl.Outcome)
		return leasestore.Attempt{Consumer: "c", Key: key, Token: cl.Token}
	}
	expire := func(key string) {
		t.Helper()
		require.NoError(t, c.HSet(ctx, prefix+"{c}:k:"+key, "lease_until_ms", 1).Err())
	}
	payload := []byte("{\"order_id\":\"o-1\"}\x00\xff binary")
	msg := &inboxdb.ParkedMessage{UUID: "u-1", Topic: "orders", Payload: payload, PayloadSize: len(payload),
		Metadata: map[string]string{"order_id": "o-1", "note": `quotes " and \ slash`}}
	requireKept := func(key string, msg *inboxdb.ParkedMessage) map[string]string {
		t.Helper()
		f := fields(key)
		require.Equal(t, "parked", f["status"])
		require.Equal(t, msg.UUID, f["m_uuid"])
		require.Equal(t, msg.Topic, f["m_topic"])
		require.Equal(t, strconv.Itoa(msg.PayloadSize), f["m_size"])
		p, ok := f["m_payload"]
		require.Equal(t, msg.Kept(), ok, "m_payload present exactly when the payload is kept")
		require.Equal(t, string(msg.Payload), p)
		var md map[string]string
		require.NoError(t, json.Unmarshal([]byte(f["m_meta"]), &md))
		want := msg.Metadata
		if want == nil {
			want = map[string]string{}
		}
		require.Equal(t, want, md)
		require.Equal(t, f["processed_at_ms"], f["parked_at_ms"], "parked when the record was")
		rec, err := b.Get(ctx, "c", key)
		require.NoError(t, err)
		require.NotEmpty(t, rec.LastError, "the reason is the record's")
		return f
	}
	noneKept := func(key string) {
		t.Helper()
		for k := range fields(key) {
			require.NotContains(t, []string{"m_uuid", "m_topic", "m_payload", "m_size", "m_meta", "parked_at_ms"}, k)
		}
	}

	t.Run("permanent failure", func(t *testing.T) {
		a := claim("perm", leasestore.Options{})
		a.Message = msg
		require.NoError(t, b.Fail(ctx, a, "invalid phone number", true))
		f := requireKept("perm", msg)
		require.Equal(t, "invalid phone number", f["last_error"])
		require.Equal(t, "1", f["attempts"])
	})

	t.Run("failure keeps nothing", func(t *testing.T) {
		a := claim("fail", leasestore.Options{})
		a.Message = msg
		require.NoError(t, b.Fail(ctx, a, "500", false))
		noneKept("fail")
	})

	t.Run("completion that can never commit", func(t *testing.T) {
		a := claim("interrupted", leasestore.Options{})
		a.Message = msg
		require.NoError(t, b.ParkInterrupted(ctx, a, "refused"))
		require.Equal(t, "refused", requireKept("interrupted", msg)["last_error"])
	})

	t.Run("stale attempt keeps nothing", func(t *testing.T) {
		stale := claim("stale", leasestore.Options{})
		expire("stale")
		claim("stale", leasestore.Options{})
		stale.Message = msg
		require.ErrorIs(t, b.Fail(ctx, stale, "late", true), leasestore.ErrLeaseLost)
		require.ErrorIs(t, b.ParkInterrupted(ctx, stale, "late"), leasestore.ErrLeaseLost)
		noneKept("stale")
	})

	t.Run("the claim that parks an interrupted key", func(t *testing.T) {
		claim("expired", leasestore.Options{})
		expire("expired")
		cl, err := b.Claim(ctx, "c", "expired", leasestore.Options{Lease: time.Minute, MaxInterrupted: 1, Message: msg})
		require.NoError(t, err)
		require.Equal(t, leasestore.Parked, cl.Outcome)
		require.True(t, cl.ParkedNow)
		require.Equal(t, cl.Record.LastError, requireKept("expired", msg)["last_error"])

		// Claims that do not park keep nothing, and a parked key's later
		// delivery changes nothing.
		claim("claimed", leasestore.Options{MaxInterrupted: 1, Message: msg})
		noneKept("claimed")
		other := &inboxdb.ParkedMessage{UUID: "u-2"}
		cl, err = b.Claim(ctx, "c", "expired", leasestore.Options{Lease: time.Minute, MaxInterrupted: 1, Message: other})
		require.NoError(t, err)
		require.False(t, cl.ParkedNow)
		requireKept("expired", msg)
	})

	t.Run("over the limit, then parked again after a release", func(t *testing.T) {
		big := &inboxdb.ParkedMessage{UUID: "u-3", Topic: "orders", PayloadSize: 5 << 20, Metadata: map[string]string{"order_id": "o-3"}}
		a := claim("again", leasestore.Options{})
		a.Message = msg
		require.NoError(t, b.Fail(ctx, a, "first", true))
		requireKept("again", msg)
		ok, err := s.Release(ctx, "c", "again", inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok)
		a = claim("again", leasestore.Options{})
		a.Message = big
		require.NoError(t, b.Fail(ctx, a, "second", true))
		f := requireKept("again", big)
		require.Equal(t, "2", f["attempts"])
		require.NotContains(t, f, "m_payload", "the first park's payload is gone")
	})

	t.Run("empty payload is kept", func(t *testing.T) {
		a := claim("empty", leasestore.Options{})
		a.Message = &inboxdb.ParkedMessage{UUID: "u-4"}
		require.NoError(t, b.Fail(ctx, a, "permanent", true))
		requireKept("empty", a.Message)
	})

	t.Run("forget deletes it", func(t *testing.T) {
		a := claim("forget", leasestore.Options{})
		a.Message = msg
		require.NoError(t, b.Fail(ctx, a, "permanent", true))
		ok, err := s.Forget(ctx, "c", "forget", inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok)
		require.Empty(t, fields("forget"))
	})
}
