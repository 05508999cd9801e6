package inbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// eachLayout runs f once per inbox layout (plain, partitioned) and driver,
// as parallel subtests named layout first ("plain/pgxpool"), each with its
// own migrated schema.
func eachLayout(t *testing.T, f func(t *testing.T, b bundle)) {
	t.Helper()
	for _, layout := range testenv.Layouts {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			if layout == "plain" { // and MariaDB's (ForEachEngine)
				testenv.ForEachEngine(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
					if d.Dialect == sqlschema.MySQL {
						f(t, newBundle(t, testenv.NewBundle(t, d).DB, 60*time.Second))
						return
					}
					f(t, newBundle(t, testenv.WithConn(testenv.SchemaLayout(t, layout), d.DB), 60*time.Second))
				})
				return
			}
			testenv.ForEachDriver(t, nil, func(t *testing.T, d testenv.Driver, _ string) {
				f(t, newBundle(t, testenv.WithConn(testenv.SchemaLayout(t, layout), d.DB), 60*time.Second))
			})
		})
	}
}

// parkedMsg is a parked message to seed, as the middleware writes it.
type parkedMsg struct {
	consumer, key, uuid, topic string
	payload                    []byte
	notKept                    bool // the payload was over the limit: not kept
	meta                       map[string]string
	reason                     string
	ago                        time.Duration // parked this long ago
}

// seed parks m's key (the inbox record, as a transactional Permanent error
// parks it) and stores its message in the table of parked messages.
func (b bundle) seed(t *testing.T, m parkedMsg) {
	t.Helper()
	require.NoError(t, b.inner.Park(b.ctx, b.db.Conn, m.consumer, m.key, m.reason, nil))
	b.seedMessage(t, m)
}

// seedMessage stores m in the table of parked messages only.
func (b bundle) seedMessage(t *testing.T, m parkedMsg) {
	t.Helper()
	if m.uuid == "" {
		m.uuid = "uuid-" + m.key
	}
	if m.meta == nil {
		m.meta = map[string]string{}
	}
	meta, err := json.Marshal(m.meta)
	require.NoError(t, err)
	var payload any = m.payload
	if m.notKept {
		payload = nil
	}
	if b.mysql() {
		b.exec(t, `INSERT INTO `+b.parkedTable()+` (consumer, message_key, message_uuid, topic, payload, payload_size, metadata, reason, attempts, first_seen_at, parked_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, 1, UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND - INTERVAL 1 MINUTE, UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND)`,
			m.consumer, m.key, m.uuid, m.topic, payload, len(m.payload), string(meta), m.reason, m.ago.Microseconds(), m.ago.Microseconds())
		return
	}
	b.exec(t, `INSERT INTO `+b.parkedTable()+` (consumer, message_key, message_uuid, topic, payload, payload_size, metadata, reason, attempts, first_seen_at, parked_at)
VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8, 1, now() - make_interval(secs => $9) - interval '1 minute', now() - make_interval(secs => $9))`,
		m.consumer, m.key, m.uuid, m.topic, payload, len(m.payload), string(meta), m.reason, m.ago.Seconds())
}

func (b bundle) parkedTable() string { return b.inner.ParkedTable() }

func (b bundle) count(t *testing.T, q string, args ...any) int64 {
	t.Helper()
	return testenv.Count(t, b.db.Conn, q, args...)
}

func (b bundle) status(t *testing.T, consumer, key string) string {
	t.Helper()
	rec, err := b.store.Get(b.ctx, consumer, key)
	if err != nil {
		require.ErrorIs(t, err, inbox.ErrNotFound)
		return ""
	}
	return rec.Status
}

// outboxRow is a row of the outbox table.
type outboxRow struct {
	Topic, UUID string
	Payload     []byte
	Metadata    map[string]string
}

func (b bundle) outbox(t *testing.T) []outboxRow {
	t.Helper()
	rows, err := b.db.Conn.QueryContext(b.ctx, b.sql(`SELECT topic, uuid, payload, metadata::text FROM `+b.db.Outbox()+` ORDER BY id`,
		`SELECT topic, uuid, payload, metadata FROM `+b.db.Outbox()+` ORDER BY id`))
	require.NoError(t, err)
	var out []outboxRow
	for rows.Next() {
		var r outboxRow
		var meta string
		require.NoError(t, rows.Scan(&r.Topic, &r.UUID, &r.Payload, &meta))
		require.NoError(t, json.Unmarshal([]byte(meta), &r.Metadata))
		out = append(out, r)
	}
	require.NoError(t, rows.Close())
	return out
}

func keysOf(ms []inbox.ParkedMessage) []string {
	out := []string{}
	for _, m := range ms {
		out = append(out, m.Consumer+"/"+m.Key)
	}
	return out
}

func TestFindParkedByEachFilter(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, b bundle) {
		b.seed(t, parkedMsg{consumer: "orders", key: "acme:1", topic: "orders.in", payload: []byte(`{"n":1}`),
			meta: map[string]string{"order_id": "A-1", "source": "web"}, reason: "Bad address", ago: 50 * time.Minute})
		b.seed(t, parkedMsg{consumer: "orders", key: "acme:2", topic: "orders.in", payload: []byte(`{"n":2}`),
			meta: map[string]string{"order_id": "A-2", "source": "web"}, reason: "card declined", ago: 40 * time.Minute})
		b.seed(t, parkedMsg{consumer: "orders", key: "globex:3", uuid: "u-3", topic: "orders.in", payload: []byte("three"),
			meta: map[string]string{"order_id": "G-3", "source": "api"}, reason: "bad ADDRESS line", ago: 30 * time.Minute})
		b.seed(t, parkedMsg{consumer: "invoices", key: "acme:1", topic: "invoices.in", payload: []byte("inv"),
			meta: map[string]string{"order_id": "A-1"}, reason: "timeout", ago: 20 * time.Minute})
		b.seed(t, parkedMsg{consumer: "invoices", key: "big", topic: "invoices.in", payload: make([]byte, 300), notKept: true,
			reason: "too big", ago: 10 * time.Minute})

		find := func(f inbox.ParkedFilter) []string {
			t.Helper()
			page, err := b.store.FindParked(b.ctx, f, inbox.Page{})
			require.NoError(t, err)
			require.Empty(t, page.Next)
			n, err := b.store.CountParked(b.ctx, f)
			require.NoError(t, err)
			require.Equal(t, int64(len(page.Messages)), n, "CountParked agrees with FindParked")
			return keysOf(page.Messages)
		}
		all := []string{"orders/acme:1", "orders/acme:2", "orders/globex:3", "invoices/acme:1", "invoices/big"}
		require.Equal(t, all, find(inbox.ParkedFilter{}), "oldest parked first")
		require.Equal(t, all[:3], find(inbox.ParkedFilter{Consumer: "orders"}))
		require.Empty(t, find(inbox.ParkedFilter{Consumer: "nobody"}), "an unknown consumer matches nothing")
		require.Equal(t, []string{"orders/acme:1", "invoices/acme:1"}, find(inbox.ParkedFilter{Key: "acme:1"}))
		require.Equal(t, []string{"orders/globex:3"}, find(inbox.ParkedFilter{MessageUUID: "u-3"}))
		require.Equal(t, []string{"orders/acme:1", "orders/acme:2", "invoices/acme:1"}, find(inbox.ParkedFilter{Tenant: "acme"}))
		require.Empty(t, find(inbox.ParkedFilter{Tenant: "acm"}), "a tenant is a whole prefix, up to ':'")
		require.Equal(t, []string{"orders/acme:1", "orders/globex:3"}, find(inbox.ParkedFilter{Reason: "bad address"}), "any case")
		require.Equal(t, []string{"orders/acme:2"}, find(inbox.ParkedFilter{Reason: "DECLINED"}))
		require.Equal(t, []string{"orders/globex:3", "invoices/acme:1"},
			find(inbox.ParkedFilter{Since: time.Now().Add(-35 * time.Minute), Before: time.Now().Add(-15 * time.Minute)}))
		require.Equal(t, []string{"invoices/big"}, find(inbox.ParkedFilter{Since: time.Now().Add(-15 * time.Minute)}))
		require.Equal(t, all[:2], find(inbox.ParkedFilter{Before: time.Now().Add(-35 * time.Minute)}))

		// A business id in the metadata; several fields all match.
		require.Equal(t, []string{"orders/acme:1", "invoices/acme:1"}, find(inbox.ParkedFilter{Metadata: map[string]string{"order_id": "A-1"}}))
		require.Equal(t, []string{"orders/acme:1"}, find(inbox.ParkedFilter{Metadata: map[string]string{"order_id": "A-1", "source": "web"}}))
		require.Empty(t, find(inbox.ParkedFilter{Metadata: map[string]string{"order_id": "A-1", "source": "api"}}))
		require.Empty(t, find(inbox.ParkedFilter{Metadata: map[string]string{"order_id": "A"}}), "exact values, not prefixes")
		require.Equal(t, []string{"orders/globex:3"}, find(inbox.ParkedFilter{Consumer: "orders", Tenant: "globex", Reason: "address",
			Metadata: map[string]string{"source": "api"}}))

		// What a message shows: without its payload in a page unless asked.
		page, err := b.store.FindParked(b.ctx, inbox.ParkedFilter{Consumer: "orders", Key: "acme:1"}, inbox.Page{})
		require.NoError(t, err)
		require.Len(t, page.Messages, 1)
		m := page.Messages[0]
		require.Nil(t, m.Payload)
		require.True(t, m.PayloadKept)
		require.Equal(t, 7, m.PayloadSize)
		require.Equal(t, "uuid-acme:1", m.UUID)
		require.Equal(t, "orders.in", m.Topic)
		require.Equal(t, map[string]string{"order_id": "A-1", "source": "web"}, m.Metadata)
		require.Equal(t, "Bad address", m.Reason)
		require.Equal(t, 1, m.Attempts)
		require.Equal(t, "parked", m.Status, "the key's inbox status, joined")
		require.WithinDuration(t, time.Now().Add(-50*time.Minute), m.ParkedAt, time.Minute)
		require.Equal(t, time.Minute, m.ParkedAt.Sub(m.FirstSeenAt).Round(time.Second))
		page, err = b.store.FindParked(b.ctx, inbox.ParkedFilter{Consumer: "orders", Key: "acme:1"}, inbox.Page{Payloads: true})
		require.NoError(t, err)
		require.Equal(t, []byte(`{"n":1}`), page.Messages[0].Payload)

		got, err := b.store.GetParked(b.ctx, "invoices", "big")
		require.NoError(t, err)
		require.False(t, got.PayloadKept)
		require.Nil(t, got.Payload)
		require.Equal(t, 300, got.PayloadSize)
		got, err = b.store.GetParked(b.ctx, "orders", "globex:3")
		require.NoError(t, err)
		require.Equal(t, []byte("three"), got.Payload, "GetParked shows the payload")
		_, err = b.store.GetParked(b.ctx, "orders", "nope")
		require.ErrorIs(t, err, inbox.ErrNotParked)
		require.ErrorContains(t, err, `"nope"`)
		require.True(t, strings.HasPrefix(err.Error(), "inbox: get parked: "), err.Error())

		// The key's status as it is now: released, or without a record.
		_, err = b.store.Release(b.ctx, "orders", "acme:2", inbox.Expect{})
		require.NoError(t, err)
		b.exec(t, `DELETE FROM `+b.db.Inbox()+` WHERE consumer = 'orders' AND message_key = 'globex:3'`)
		page, err = b.store.FindParked(b.ctx, inbox.ParkedFilter{Consumer: "orders"}, inbox.Page{})
		require.NoError(t, err)
		var statuses []string
		for _, m := range page.Messages {
			statuses = append(statuses, m.Status)
		}
		require.Equal(t, []string{"parked", "failed", ""}, statuses)

		// Metadata written by hand with values that are not strings.
		b.exec(t, `UPDATE `+b.parkedTable()+` SET metadata = '{"n": 5, "s": "x"}' WHERE consumer = 'invoices' AND message_key = 'big'`)
		got, err = b.store.GetParked(b.ctx, "invoices", "big")
		require.NoError(t, err)
		require.Equal(t, map[string]string{"n": "5", "s": "x"}, got.Metadata)
	})
}

func TestFindParkedRefusesInvalidRequests(t *testing.T) {
	t.Parallel()
	db := testenv.Schema(t)
	store, err := inbox.NewStore(db)
	require.NoError(t, err)
	ctx := context.Background()
	now := time.Now()
	for _, tc := range []struct {
		f    inbox.ParkedFilter
		p    inbox.Page
		want string
	}{
		{inbox.ParkedFilter{Tenant: "a:b"}, inbox.Page{}, "ParkedFilter.Tenant"},
		{inbox.ParkedFilter{Key: "a\x00b"}, inbox.Page{}, "ParkedFilter.Key"},
		{inbox.ParkedFilter{Consumer: "\xff"}, inbox.Page{}, "ParkedFilter.Consumer"},
		{inbox.ParkedFilter{Consumer: strings.Repeat("c", 256)}, inbox.Page{}, "ParkedFilter.Consumer"},
		{inbox.ParkedFilter{Reason: "\x00"}, inbox.Page{}, "ParkedFilter.Reason"},
		{inbox.ParkedFilter{Since: now, Before: now}, inbox.Page{}, "ParkedFilter.Before"},
		{inbox.ParkedFilter{Metadata: map[string]string{"": "x"}}, inbox.Page{}, "ParkedFilter.Metadata"},
		{inbox.ParkedFilter{Metadata: map[string]string{"k": "\x00"}}, inbox.Page{}, "ParkedFilter.Metadata"},
		{inbox.ParkedFilter{}, inbox.Page{Limit: 1001}, "Page.Limit"},
		{inbox.ParkedFilter{}, inbox.Page{Limit: -1}, "Page.Limit"},
		{inbox.ParkedFilter{}, inbox.Page{After: "not a cursor"}, "Page.After"},
	} {
		_, err := store.FindParked(ctx, tc.f, tc.p)
		require.ErrorIs(t, err, inbox.ErrInvalidFilter, tc.want)
		require.ErrorContains(t, err, tc.want)
	}
	_, err = store.CountParked(ctx, inbox.ParkedFilter{Tenant: "a:b"})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	_, err = store.GetParked(ctx, "", "k")
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	_, err = store.ReplayParked(ctx, "c", "", inbox.ReplayOptions{})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	_, err = store.ReplayParked(ctx, "c", "k", inbox.ReplayOptions{Topic: "a\x00"})
	require.ErrorContains(t, err, "ReplayOptions.Topic")
	require.ErrorIs(t, store.DiscardParked(ctx, "", "k", inbox.DiscardOptions{}), inbox.ErrInvalidFilter)

	// A bulk operation needs a filter, or All.
	_, err = store.ReplayParkedMatching(ctx, inbox.ParkedFilter{}, inbox.ReplayOptions{})
	require.ErrorIs(t, err, inbox.ErrInvalidFilter)
	require.ErrorContains(t, err, "ReplayOptions.All")
	_, err = store.DiscardParkedMatching(ctx, inbox.ParkedFilter{}, inbox.DiscardOptions{})
	require.ErrorContains(t, err, "DiscardOptions.All")
	_, err = store.DiscardParkedMatching(ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.DiscardOptions{BatchSize: 5000})
	require.ErrorContains(t, err, "DiscardOptions.BatchSize")
	rep, err := store.ReplayParkedMatching(ctx, inbox.ParkedFilter{}, inbox.ReplayOptions{All: true})
	require.NoError(t, err, "All: every parked message (there is none)")
	require.Zero(t, rep)
}

func TestFindParkedPages(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, b bundle) {
		// 25 messages, some parked at the same instant (the cursor's tie
		// breakers: consumer, then key), across two consumers.
		want := map[string]bool{}
		for i := range 25 {
			consumer := []string{"a", "b"}[i%2]
			key := fmt.Sprintf("k%02d", i)
			b.seed(t, parkedMsg{consumer: consumer, key: key, topic: "t", payload: []byte(key),
				meta: map[string]string{"batch": "x"}, reason: "r", ago: time.Duration(10-i/3) * time.Minute})
			want[consumer+"/"+key] = true
		}
		b.exec(t, `UPDATE `+b.parkedTable()+b.sql(` SET parked_at = date_trunc('second', parked_at)`, ` SET parked_at = DATE_FORMAT(parked_at, '%Y-%m-%d %H:%i:%s')`))
		f := inbox.ParkedFilter{Metadata: map[string]string{"batch": "x"}}
		n, err := b.store.CountParked(b.ctx, f)
		require.NoError(t, err)
		require.Equal(t, int64(25), n)

		var seen []inbox.ParkedMessage
		var sizes []int
		p := inbox.Page{Limit: 10, Payloads: true}
		for {
			page, err := b.store.FindParked(b.ctx, f, p)
			require.NoError(t, err)
			sizes = append(sizes, len(page.Messages))
			seen = append(seen, page.Messages...)
			if page.Next == "" {
				break
			}
			p.After = page.Next
		}
		require.Equal(t, []int{10, 10, 5}, sizes)
		got := map[string]bool{}
		for i, m := range seen {
			got[m.Consumer+"/"+m.Key] = true
			require.Equal(t, []byte(m.Key), m.Payload)
			if i > 0 {
				prev := seen[i-1]
				require.False(t, m.ParkedAt.Before(prev.ParkedAt), "oldest first")
				if m.ParkedAt.Equal(prev.ParkedAt) {
					require.True(t, prev.Consumer < m.Consumer || prev.Consumer == m.Consumer && prev.Key < m.Key)
				}
			}
		}
		require.Equal(t, want, got, "every message once")

		// A page that ends exactly at the last message has no Next.
		page, err := b.store.FindParked(b.ctx, f, inbox.Page{Limit: 25})
		require.NoError(t, err)
		require.Len(t, page.Messages, 25)
		require.Empty(t, page.Next)

		// Paging within one consumer, with the cursor of a message replayed
		// meanwhile: the next page starts after it all the same.
		page, err = b.store.FindParked(b.ctx, inbox.ParkedFilter{Consumer: "a"}, inbox.Page{Limit: 5})
		require.NoError(t, err)
		last := page.Messages[4]
		_, err = b.store.ReplayParked(b.ctx, last.Consumer, last.Key, inbox.ReplayOptions{})
		require.NoError(t, err)
		next, err := b.store.FindParked(b.ctx, inbox.ParkedFilter{Consumer: "a"}, inbox.Page{Limit: 100, After: page.Next})
		require.NoError(t, err)
		require.Len(t, next.Messages, 13-5)
	})
}

// What the operator contract (internal/ops/opstest: ReplayParked) does
// not say of the PostgreSQL store: a replay leaves no row in the table of
// parked messages, and a second replay's error says why, with inbox's
// prefix.
func TestReplayParkedLeavesNoRow(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, b bundle) {
		b.seed(t, parkedMsg{consumer: "orders", key: "k1", uuid: "018f-uuid-1", topic: "orders.in", payload: []byte(`{"order":"A-1042"}`)})
		_, err := b.store.ReplayParked(b.ctx, "orders", "k1", inbox.ReplayOptions{})
		require.NoError(t, err)
		require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.parkedTable()))
		_, err = b.store.ReplayParked(b.ctx, "orders", "k1", inbox.ReplayOptions{})
		require.ErrorIs(t, err, inbox.ErrNotParked)
		require.ErrorContains(t, err, "replayed or discarded meanwhile")
		require.True(t, strings.HasPrefix(err.Error(), "inbox: replay parked: "), err.Error())
		require.Len(t, b.outbox(t), 1)
	})
}

// A parked message whose key has no record (removed by hand, or purged
// after its release) is replayed: only the outbox row is written. The
// refusals and the other replays are the operator contract's
// (internal/ops/opstest: ReplayParkedRefusals).
func TestReplayParkedWithoutRecord(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, b bundle) {
		b.seedMessage(t, parkedMsg{consumer: "c", key: "norecord", topic: "t", payload: []byte("n")})
		m, err := b.store.ReplayParked(b.ctx, "c", "norecord", inbox.ReplayOptions{Topic: "over"})
		require.NoError(t, err)
		require.Equal(t, "over", m.Topic)
		require.Equal(t, "", b.status(t, "c", "norecord"))
		require.Len(t, b.outbox(t), 1)
	})
}

func TestReplayParkedTxRollsBack(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, b bundle) {
		b.seed(t, parkedMsg{consumer: "c", key: "k", topic: "t", payload: []byte("x")})
		tx, err := b.db.Conn.BeginTx(b.ctx, nil)
		require.NoError(t, err)
		_, err = b.store.ReplayParkedTx(b.ctx, tx, "c", "k", inbox.ReplayOptions{})
		require.NoError(t, err)
		require.NoError(t, tx.Rollback())
		require.Equal(t, "parked", b.status(t, "c", "k"))
		require.Empty(t, b.outbox(t))
		_, err = b.store.GetParked(b.ctx, "c", "k")
		require.NoError(t, err, "a rolled back replay leaves the message parked")

		tx, err = b.db.Conn.BeginTx(b.ctx, nil)
		require.NoError(t, err)
		_, err = b.store.ReplayParkedTx(b.ctx, tx, "c", "k", inbox.ReplayOptions{})
		require.NoError(t, err)
		require.NoError(t, tx.Commit())
		require.Equal(t, "failed", b.status(t, "c", "k"))
		require.Len(t, b.outbox(t), 1)

		b.seed(t, parkedMsg{consumer: "c", key: "d", topic: "t", payload: []byte("x")})
		tx, err = b.db.Conn.BeginTx(b.ctx, nil)
		require.NoError(t, err)
		require.NoError(t, b.store.DiscardParkedTx(b.ctx, tx, "c", "d", inbox.DiscardOptions{Forget: true}))
		require.NoError(t, tx.Rollback())
		require.Equal(t, "parked", b.status(t, "c", "d"))
	})
}

// TestReplayParkedConcurrently: operators replaying one message at once
// write it to the outbox once; the others learn it is no longer parked.
func TestReplayParkedConcurrently(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, b bundle) {
		const keys, replayers = 5, 6
		for i := range keys {
			b.seed(t, parkedMsg{consumer: "c", key: fmt.Sprint("k", i), topic: "t", payload: []byte("x")})
		}
		var wg sync.WaitGroup
		errs := make([][]error, keys)
		start := make(chan struct{})
		for i := range keys {
			errs[i] = make([]error, replayers)
			for j := range replayers {
				wg.Go(func() {
					<-start
					if j%2 == 0 {
						_, errs[i][j] = b.store.ReplayParked(b.ctx, "c", fmt.Sprint("k", i), inbox.ReplayOptions{})
					} else {
						_, errs[i][j] = b.store.ReplayParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "c", Key: fmt.Sprint("k", i)}, inbox.ReplayOptions{})
					}
				})
			}
		}
		close(start)
		wg.Wait()
		for i := range keys {
			ok := 0
			for j, err := range errs[i] {
				if err == nil && j%2 == 0 {
					ok++
					continue
				}
				if j%2 == 0 {
					require.ErrorIs(t, err, inbox.ErrNotParked)
				} else {
					require.NoError(t, err)
				}
			}
			require.LessOrEqual(t, ok, 1, "key %d", i)
		}
		rows := b.outbox(t)
		require.Len(t, rows, keys, "each message written once")
		uuids := map[string]bool{}
		for _, r := range rows {
			uuids[r.UUID] = true
		}
		require.Len(t, uuids, keys)
		require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.parkedTable()))
	})
}

// A discard's error carries inbox's prefix; the discard itself is the
// operator contract's (internal/ops/opstest: DiscardParked).
func TestDiscardParkedErrorPrefix(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.seed(t, parkedMsg{consumer: "c", key: "keep", topic: "t", payload: []byte("x")})
		require.NoError(t, b.store.DiscardParked(b.ctx, "c", "keep", inbox.DiscardOptions{}))
		err := b.store.DiscardParked(b.ctx, "c", "keep", inbox.DiscardOptions{})
		require.ErrorIs(t, err, inbox.ErrNotParked, "discarded once")
		require.True(t, strings.HasPrefix(err.Error(), "inbox: discard parked: "), err.Error())
	})
}

func TestDiscardParkedMatching(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, b bundle) {
		for i := range 25 {
			b.seed(t, parkedMsg{consumer: "c", key: fmt.Sprintf("a%02d", i), topic: "t", payload: []byte("x"), reason: "Schema mismatch"})
			b.seed(t, parkedMsg{consumer: "c", key: fmt.Sprintf("b%02d", i), topic: "t", payload: []byte("x"), reason: "other"})
		}
		n, err := b.store.DiscardParkedMatching(b.ctx, inbox.ParkedFilter{Reason: "schema"}, inbox.DiscardOptions{BatchSize: 10})
		require.NoError(t, err)
		require.Equal(t, int64(25), n)
		require.Equal(t, int64(25), b.count(t, `SELECT count(*) FROM `+b.parkedTable()))
		require.Equal(t, int64(25), b.count(t, `SELECT count(*) FROM `+b.db.Inbox()+` WHERE status = 'parked'`), "the others stay parked")
		require.Equal(t, int64(25), b.count(t, `SELECT count(*) FROM `+b.db.Inbox()+` WHERE status = 'discarded' AND message_key LIKE 'a%'`),
			"the discarded ones' keys are discarded, no longer parked")

		n, err = b.store.DiscardParkedMatching(b.ctx, inbox.ParkedFilter{Consumer: "c"}, inbox.DiscardOptions{Forget: true, BatchSize: 7})
		require.NoError(t, err)
		require.Equal(t, int64(25), n)
		require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.parkedTable()))
		require.Equal(t, int64(25), b.count(t, `SELECT count(*) FROM `+b.db.Inbox()), "the discarded ones' keys are forgotten, the others' kept")
		require.Zero(t, b.count(t, `SELECT count(*) FROM `+b.db.Inbox()+` WHERE message_key LIKE 'b%'`))
	})
}

func TestForgetAndReleaseOfAParkedMessage(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, b bundle) {
		b.seed(t, parkedMsg{consumer: "c", key: "f", topic: "t", payload: []byte("x")})
		b.seed(t, parkedMsg{consumer: "c", key: "r", topic: "t", payload: []byte("x")})

		// Forget takes the parked message with the record.
		ok, err := b.store.Forget(b.ctx, "c", "f", inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok)
		_, err = b.store.GetParked(b.ctx, "c", "f")
		require.ErrorIs(t, err, inbox.ErrNotParked)
		b.seedMessage(t, parkedMsg{consumer: "c", key: "f", topic: "t", payload: []byte("x")})
		ok, err = b.store.Forget(b.ctx, "c", "f", inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok, "a parked message without a record counts")
		ok, err = b.store.Forget(b.ctx, "c", "f", inbox.Expect{})
		require.NoError(t, err)
		require.False(t, ok)

		// Release keeps it, listed with the key's status, until replayed.
		ok, err = b.store.Release(b.ctx, "c", "r", inbox.Expect{})
		require.NoError(t, err)
		require.True(t, ok)
		m, err := b.store.GetParked(b.ctx, "c", "r")
		require.NoError(t, err)
		require.Equal(t, "failed", m.Status)
		b.claim(t, "c", "r") // the next delivery ran it
		m, err = b.store.GetParked(b.ctx, "c", "r")
		require.NoError(t, err)
		require.Equal(t, "done", m.Status)
		_, err = b.store.ReplayParked(b.ctx, "c", "r", inbox.ReplayOptions{})
		require.ErrorIs(t, err, inbox.ErrNotReplayable, "processed since: a replay would be a duplicate")
		require.NoError(t, b.store.DiscardParked(b.ctx, "c", "r", inbox.DiscardOptions{}))
		require.Equal(t, "done", b.status(t, "c", "r"))
	})
}

// TestParkedNotMigrated: a schema migrated before the table of parked
// messages existed gets the not-migrated hint.
func TestParkedNotMigrated(t *testing.T) {
	t.Parallel()
	db := testenv.Schema(t)
	store, err := inbox.NewStore(db)
	require.NoError(t, err)
	inner, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	require.NoError(t, err)
	_, err = db.Conn.ExecContext(context.Background(), `DROP TABLE `+inner.ParkedTable())
	require.NoError(t, err)
	_, err = store.FindParked(context.Background(), inbox.ParkedFilter{}, inbox.Page{})
	require.ErrorIs(t, err, sqlschema.ErrNotMigrated)
}
