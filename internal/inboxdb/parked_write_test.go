package inboxdb_test

// Every park keeps the message it parked, in the same statement: Park,
// Fail (permanent), ParkInterrupted and the lease claim that parks; a key
// that was not parked keeps nothing; Forget deletes what was kept.

import (
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

// keptRow is a row of the table of parked messages.
type keptRow struct {
	UUID, Topic    string
	Payload        []byte
	PayloadNull    bool
	PayloadSize    int
	Metadata       map[string]string
	Reason         string
	Attempts       int
	FirstSeenAt    time.Time
	ParkedAt       time.Time
	ProcessedAtRec time.Time // the record's processed_at
}

// kept reads the parked message of (consumer, key); false when none.
func (b bundle) kept(t *testing.T, consumer, key string) (keptRow, bool) {
	t.Helper()
	var r keptRow
	var meta string
	err := seam.QueryRow(b.ctx, b.db, b.sql(`SELECT message_uuid, topic, coalesce(payload, ''), payload IS NULL, payload_size, metadata::text,
reason, attempts, first_seen_at, parked_at FROM `+b.store.ParkedTable()+` WHERE consumer = $1 AND message_key = $2`,
		`SELECT message_uuid, topic, COALESCE(payload, ''), payload IS NULL, payload_size, metadata,
reason, attempts, first_seen_at, parked_at FROM `+b.store.ParkedTable()+` WHERE consumer = ? AND message_key = ?`),
		[]any{consumer, key}, &r.UUID, &r.Topic, &r.Payload, &r.PayloadNull, &r.PayloadSize, &meta, &r.Reason, &r.Attempts, &r.FirstSeenAt, &r.ParkedAt)
	if errors.Is(err, seam.ErrNoRows) {
		return keptRow{}, false
	}
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal([]byte(meta), &r.Metadata))
	return r, true
}

// requireKept asserts that (consumer, key) keeps msg, with the record's
// reason, attempts, first-seen and parked (processed) times.
func (b bundle) requireKept(t *testing.T, consumer, key string, msg inboxdb.ParkedMessage) keptRow {
	t.Helper()
	got, ok := b.kept(t, consumer, key)
	require.True(t, ok, "the park kept the message of %q", key)
	require.Equal(t, msg.UUID, got.UUID)
	require.Equal(t, msg.Topic, got.Topic)
	require.Equal(t, len(msg.Payload), got.PayloadSize)
	require.False(t, got.PayloadNull)
	require.Equal(t, string(msg.Payload), string(got.Payload))
	want := msg.Metadata
	if want == nil {
		want = map[string]string{}
	}
	require.Equal(t, want, got.Metadata)
	rec, err := b.store.Lookup(b.ctx, b.db, consumer, key)
	require.NoError(t, err)
	require.Equal(t, inboxdb.StatusParked, rec.Status)
	require.Equal(t, rec.LastError, got.Reason)
	require.Equal(t, rec.Attempts, got.Attempts)
	require.True(t, rec.FirstSeenAt.Equal(got.FirstSeenAt), "first seen %v, kept %v", rec.FirstSeenAt, got.FirstSeenAt)
	require.True(t, rec.ProcessedAt.Equal(got.ParkedAt), "parked %v, kept %v", *rec.ProcessedAt, got.ParkedAt)
	return got
}

func orderMessage(uuid string) *inboxdb.ParkedMessage {
	payload := []byte(`{"order_id":"o-` + uuid + `","amount":12}` + "\x00\xff binary tail")
	return &inboxdb.ParkedMessage{UUID: uuid, Topic: "orders", Payload: payload, PayloadSize: len(payload),
		Metadata: map[string]string{"order_id": "o-" + uuid, "traceparent": "00-abc-def-01", "note": `quotes " and \ slash`}}
}

func TestParkKeepsTheMessage(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		t.Run("new key", func(t *testing.T) {
			msg := orderMessage("u-1")
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "k1", "400 invalid phone number", msg))
			got := b.requireKept(t, "c", "k1", *msg)
			require.Equal(t, "400 invalid phone number", got.Reason)
			require.Equal(t, 1, got.Attempts)
			// The same key of another consumer is another row.
			_, ok := b.kept(t, "other", "k1")
			require.False(t, ok)
		})

		t.Run("done meanwhile keeps nothing", func(t *testing.T) {
			require.True(t, b.claim(t, "c", "done").Claimed)
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "done", "too late", orderMessage("u-2")))
			_, ok := b.kept(t, "c", "done")
			require.False(t, ok, "a key done meanwhile stays done and keeps nothing")
		})

		t.Run("parked already keeps the first", func(t *testing.T) {
			first := orderMessage("u-3")
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "twice", "first", first))
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "twice", "second", orderMessage("u-3b")))
			require.Equal(t, "first", b.requireKept(t, "c", "twice", *first).Reason)
		})

		t.Run("parked again after a release replaces it", func(t *testing.T) {
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "again", "first", orderMessage("u-4")))
			ok, err := b.store.Release(b.ctx, b.db, "c", "again")
			require.NoError(t, err)
			require.True(t, ok)
			second := &inboxdb.ParkedMessage{UUID: "u-4b", Topic: "orders.v2", Payload: []byte("second"), PayloadSize: 6}
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "again", "second", second))
			got := b.requireKept(t, "c", "again", *second)
			require.Equal(t, "second", got.Reason)
			require.Equal(t, 2, got.Attempts)
		})

		t.Run("payload over the limit", func(t *testing.T) {
			msg := &inboxdb.ParkedMessage{UUID: "u-5", Topic: "orders", PayloadSize: 5 << 20, Metadata: map[string]string{"order_id": "o-5"}}
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "big", "permanent", msg))
			got, ok := b.kept(t, "c", "big")
			require.True(t, ok)
			require.True(t, got.PayloadNull, "not kept: NULL")
			require.Equal(t, 5<<20, got.PayloadSize)
			require.Equal(t, map[string]string{"order_id": "o-5"}, got.Metadata, "metadata is always kept")
		})

		t.Run("empty payload is kept", func(t *testing.T) {
			msg := &inboxdb.ParkedMessage{UUID: "u-6"}
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "empty", "permanent", msg))
			got := b.requireKept(t, "c", "empty", *msg)
			require.Zero(t, got.PayloadSize)
		})

		t.Run("text PostgreSQL cannot hold", func(t *testing.T) {
			msg := &inboxdb.ParkedMessage{UUID: "u-\x00-7", Topic: "orders", Payload: []byte("p"), PayloadSize: 1,
				Metadata: map[string]string{"bad\xff": "nul \x00 here", "order_id": "o-7"}}
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "text", "permanent", msg), "the park never fails for its content")
			got, ok := b.kept(t, "c", "text")
			require.True(t, ok)
			require.Equal(t, "u-\uFFFD-7", got.UUID)
			require.Equal(t, map[string]string{"bad\uFFFD": "nul \uFFFD here", "order_id": "o-7"}, got.Metadata)
			require.True(t, got.PayloadNull, "a changed message is not kept for a replay")
			require.Equal(t, 1, got.PayloadSize)
		})

		t.Run("in a transaction that rolls back", func(t *testing.T) {
			tx := b.begin(t)
			require.NoError(t, b.store.Park(b.ctx, tx, "c", "rolled-back", "x", orderMessage("u-8")))
			require.NoError(t, tx.Rollback())
			_, ok := b.kept(t, "c", "rolled-back")
			require.False(t, ok)
		})

		t.Run("forget deletes it", func(t *testing.T) {
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "forget", "permanent", orderMessage("u-9")))
			ok, err := b.store.Forget(b.ctx, b.db, "c", "forget")
			require.NoError(t, err)
			require.True(t, ok)
			_, ok = b.kept(t, "c", "forget")
			require.False(t, ok, "forgotten with its record")
			require.NoError(t, b.store.Park(b.ctx, b.db, "c", "forget", "again", nil))
			_, ok = b.kept(t, "c", "forget")
			require.False(t, ok, "a nil message keeps nothing")
		})
	})
}

func TestLeaseParksKeepTheMessage(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		const c = "c"
		t.Run("permanent failure", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "perm", time.Hour, retryExpired)
			msg := orderMessage("u-1")
			require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "perm", Token: lc.Token, Message: msg}, "invalid phone number", true))
			got := b.requireKept(t, c, "perm", *msg)
			require.Equal(t, "invalid phone number", got.Reason)
			require.Equal(t, 1, got.Attempts)
		})

		t.Run("failure keeps nothing", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "fail", time.Hour, retryExpired)
			require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "fail", Token: lc.Token, Message: orderMessage("u-2")}, "500", false))
			_, ok := b.kept(t, c, "fail")
			require.False(t, ok)
		})

		t.Run("completion that can never commit", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "interrupted", time.Hour, retryExpired)
			msg := orderMessage("u-3")
			require.NoError(t, b.store.ParkInterrupted(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "interrupted", Token: lc.Token, Message: msg}, "constraint failed at COMMIT"))
			require.Equal(t, "constraint failed at COMMIT", b.requireKept(t, c, "interrupted", *msg).Reason)
		})

		t.Run("stale attempt keeps nothing", func(t *testing.T) {
			stale := leaseAcquire(t, b, c, "stale", time.Hour, retryExpired)
			leaseExpire(t, b, c, "stale")
			leaseAcquire(t, b, c, "stale", time.Hour, retryExpired)
			require.ErrorIs(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "stale", Token: stale.Token, Message: orderMessage("u-4")}, "late", true), inboxdb.ErrLeaseLost)
			require.ErrorIs(t, b.store.ParkInterrupted(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "stale", Token: stale.Token, Message: orderMessage("u-4")}, "late"), inboxdb.ErrLeaseLost)
			_, ok := b.kept(t, c, "stale")
			require.False(t, ok)
		})

		t.Run("the claim that parks an interrupted key", func(t *testing.T) {
			leaseAcquire(t, b, c, "expired", time.Hour, parkExpired)
			leaseExpire(t, b, c, "expired")
			msg := orderMessage("u-5")
			lc, err := b.store.ClaimLease(b.ctx, b.db, c, "expired", inboxdb.LeaseOptions{Lease: time.Hour, MaxInterrupted: parkExpired, Message: msg})
			require.NoError(t, err)
			require.True(t, lc.ParkedNow)
			require.Equal(t, inboxdb.StatusParked, lc.Record.Status)
			require.Contains(t, lc.Record.LastError, "lease expired during attempt 1")
			got := b.requireKept(t, c, "expired", *msg)
			require.Equal(t, lc.Record.LastError, got.Reason)

			// Claims that do not park keep nothing.
			lc, err = b.store.ClaimLease(b.ctx, b.db, c, "claimed", inboxdb.LeaseOptions{Lease: time.Hour, MaxInterrupted: parkExpired, Message: msg})
			require.NoError(t, err)
			require.Equal(t, inboxdb.LeaseAcquired, lc.Outcome)
			_, ok := b.kept(t, c, "claimed")
			require.False(t, ok)
			dup, err := b.store.ClaimLease(b.ctx, b.db, c, "expired", inboxdb.LeaseOptions{Lease: time.Hour, MaxInterrupted: parkExpired, Message: orderMessage("u-6")})
			require.NoError(t, err)
			require.Equal(t, inboxdb.LeaseParked, dup.Outcome)
			require.False(t, dup.ParkedNow)
			require.Equal(t, "u-5", b.requireKept(t, c, "expired", *msg).UUID, "a parked key's later delivery changes nothing")
		})

		t.Run("forget deletes it", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "forget", time.Hour, retryExpired)
			require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "forget", Token: lc.Token, Message: orderMessage("u-7")}, "permanent", true))
			ok, err := b.store.Forget(b.ctx, b.db, c, "forget")
			require.NoError(t, err)
			require.True(t, ok)
			_, ok = b.kept(t, c, "forget")
			require.False(t, ok)
		})
	})
}

func TestParkedMessageRow(t *testing.T) {
	t.Parallel()
	t.Run("as it came", func(t *testing.T) {
		r := inboxdb.ParkedMessage{UUID: "u", Topic: "t", Payload: []byte("p"), PayloadSize: 1, Metadata: map[string]string{"a": "<b>&"}}.Row()
		require.Equal(t, inboxdb.ParkedFields{UUID: "u", Topic: "t", Payload: []byte("p"), PayloadSize: 1, Metadata: `{"a":"\u003cb\u003e\u0026"}`}, r)
	})
	t.Run("not kept", func(t *testing.T) {
		r := inboxdb.ParkedMessage{UUID: "u", PayloadSize: 10}.Row()
		require.Nil(t, r.Payload)
		require.Equal(t, 10, r.PayloadSize)
		require.Equal(t, "{}", r.Metadata)
	})
	t.Run("empty is kept", func(t *testing.T) {
		r := inboxdb.ParkedMessage{UUID: "u"}.Row()
		require.NotNil(t, r.Payload)
		require.Empty(t, r.Payload)
	})
	t.Run("a long UUID is cut, and the payload not kept", func(t *testing.T) {
		r := inboxdb.ParkedMessage{UUID: strings.Repeat("u", 5000), Payload: []byte("p"), PayloadSize: 1}.Row()
		require.LessOrEqual(t, len(r.UUID), 1024+len("..."))
		require.Nil(t, r.Payload)
		require.Equal(t, 1, r.PayloadSize)
	})
	t.Run("metadata over the guard", func(t *testing.T) {
		md := map[string]string{"order_id": "o-1"}
		for i := range 3000 {
			md["h"+strconv.Itoa(i)] = strings.Repeat("v", 1000)
		}
		r := inboxdb.ParkedMessage{UUID: "u", Payload: []byte("p"), PayloadSize: 1, Metadata: md}.Row()
		require.LessOrEqual(t, len(r.Metadata), inboxdb.MaxParkedMetadata)
		var got map[string]string
		require.NoError(t, json.Unmarshal([]byte(r.Metadata), &got))
		require.Equal(t, "o-1", got["order_id"], "the fields in key order while they fit")
		for k, v := range got {
			require.LessOrEqual(t, len(v), inboxdb.MaxParkedMetadataField+len("..."), k)
		}
		require.Len(t, got, len(md), "every field fits once cut")
		require.Nil(t, r.Payload, "a changed message is not kept for a replay")
	})
}
