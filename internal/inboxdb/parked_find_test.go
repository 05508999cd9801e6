package inboxdb_test

// FindParked of one consumer reads the page's keys first, from the
// parked_consumer_at index (consumer, parked_at, message_key COLLATE "C"), then their rows:
// the same rows, in the same order and pages, as the plain query; and the
// plan reads the consumer's range of that index, never a walk of the
// parked_at index that filters out the other consumers' messages.

import (
	"context"
	"hash/fnv"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/parked"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// findConsumers are the consumers of TestFindParkedKeysFirstSameAsPlain:
// names in byte order other than in a linguistic one, and one that parks
// only recently.
var findConsumers = []string{"a", "B", "b-incident", "é-unicode", "c"}

// seedFind parks 40 messages per consumer of findConsumers: keys in three
// tenants and none, in upper and lower case and not ASCII, parked at 13
// different minutes before base (so that many share a parked_at, within
// a consumer and across them; b-incident's at 5 seconds instead), some
// with an inbox record (done, parked or failed), some with a payload.
func seedFind(t *testing.T, b bundle, base time.Time) {
	t.Helper()
	if b.mysql() {
		seedFindMySQL(t, b, base)
		return
	}
	b.exec(t, `INSERT INTO `+b.store.ParkedTable()+` (consumer, message_key, message_uuid, topic, payload, payload_size, metadata, reason, attempts, first_seen_at, parked_at)
SELECT c, k, 'uuid-' || c || '-' || i, 'topic', CASE WHEN i % 3 = 0 THEN convert_to('payload ' || i, 'UTF8') END, 9,
  jsonb_build_object('n', i::text), 'reason ' || i, i % 4,
  $1::timestamptz - interval '1 hour',
  CASE WHEN c = 'b-incident' THEN $1::timestamptz - (i % 5) * interval '1 second' ELSE $1::timestamptz - (i % 13) * interval '1 minute' END
FROM unnest($2::text[]) c, generate_series(1, 40) i,
  LATERAL (SELECT (ARRAY['acme:', 'globex:', '', 'Acme:'])[1 + i % 4] || (ARRAY['k', 'K', 'é', 'z', '_', 'Z'])[1 + i % 6] || i AS k) key`,
		base, pgTextArray(findConsumers))
	b.exec(t, `INSERT INTO `+b.store.Table()+` (consumer, message_key, status, processed_at)
SELECT consumer, message_key, (ARRAY['done', 'parked', 'failed'])[1 + abs(hashtext(message_key)) % 3], now()
FROM `+b.store.ParkedTable()+` WHERE abs(hashtext(message_key || consumer)) % 2 = 0`)
	b.exec(t, `ANALYZE `+b.store.ParkedTable())
}

// seedFindMySQL is seedFind's rows on MySQL, one INSERT each (the
// record's status and presence chosen by an FNV hash of the key).
func seedFindMySQL(t *testing.T, b bundle, base time.Time) {
	t.Helper()
	prefixes, letters := []string{"acme:", "globex:", "", "Acme:"}, []string{"k", "K", "é", "z", "_", "Z"}
	for _, c := range findConsumers {
		for i := 1; i <= 40; i++ {
			k := prefixes[i%4] + letters[i%6] + strconv.Itoa(i)
			var payload []byte
			if i%3 == 0 {
				payload = []byte("payload " + strconv.Itoa(i))
			}
			at := base.Add(-time.Duration(i%13) * time.Minute)
			if c == "b-incident" {
				at = base.Add(-time.Duration(i%5) * time.Second)
			}
			b.exec(t, `INSERT INTO `+b.store.ParkedTable()+` (consumer, message_key, message_uuid, topic, payload, payload_size, metadata, reason, attempts, first_seen_at, parked_at)
VALUES (?, ?, ?, 'topic', ?, 9, JSON_OBJECT('n', ?), ?, ?, ?, ?)`, c, k, "uuid-"+c+"-"+strconv.Itoa(i), payload, strconv.Itoa(i),
				"reason "+strconv.Itoa(i), i%4, base.Add(-time.Hour).UTC(), at.UTC())
			h := fnv.New32a()
			_, _ = h.Write([]byte(k + c))
			if h.Sum32()%2 == 0 {
				b.exec(t, `INSERT INTO `+b.store.Table()+` (consumer, message_key, status, first_seen_at, processed_at)
VALUES (?, ?, ?, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6))`, c, k, []string{"done", "parked", "failed"}[h.Sum32()/2%3])
			}
		}
	}
}

// pgTextArray is a text[] literal of ss (no quotes nor backslashes in them).
func pgTextArray(ss []string) string {
	return `{"` + strings.Join(ss, `","`) + `"}`
}

func TestFindParkedKeysFirstSameAsPlain(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		base := time.Now().UTC().Truncate(time.Second)
		seedFind(t, b, base)
		minute := func(n int) time.Time { return base.Add(-time.Duration(n) * time.Minute) }

		var filters []parked.Filter
		for _, c := range append(findConsumers, "nobody") {
			filters = append(filters,
				parked.Filter{Consumer: c},
				parked.Filter{Consumer: c, Tenant: "acme"},
				parked.Filter{Consumer: c, Tenant: "Acme"},
				parked.Filter{Consumer: c, Since: minute(6)},
				parked.Filter{Consumer: c, Before: minute(3)},
				parked.Filter{Consumer: c, Since: minute(10), Before: minute(2)},
				parked.Filter{Consumer: c, Tenant: "globex", Since: minute(12), Before: base.Add(-2 * time.Second)},
			)
		}
		find := func(f parked.Filter, c *parked.Cursor, limit int, payloads, keysFirst bool) []inboxdb.ParkedRow {
			t.Helper()
			rs, err := b.store.FindParkedWith(b.ctx, b.db, f, c, limit, payloads, keysFirst)
			require.NoError(t, err)
			return rs
		}
		nonEmpty := 0
		for i, f := range filters {
			require.NoError(t, f.Validate())
			require.True(t, inboxdb.KeysFirst(f), "%+v", f)
			payloads := i%2 == 0
			all := find(f, nil, 1000, payloads, false)
			require.Equal(t, all, find(f, nil, 1000, payloads, true), "%+v: all at once", f)
			if len(all) > 0 {
				nonEmpty++
			}
			got, err := b.store.FindParked(b.ctx, b.db, f, nil, 1000, payloads)
			require.NoError(t, err)
			require.Equal(t, all, got, "%+v: FindParked", f)

			// The pages, each from the last row's cursor, alike and
			// together all of them.
			for _, limit := range []int{1, 7} {
				if limit == 1 && i%7 != 0 {
					continue // one page a row: the consumer alone is enough
				}
				var walked []inboxdb.ParkedRow
				var c *parked.Cursor
				for page := 0; ; page++ {
					plain := find(f, c, limit, payloads, false)
					require.Equal(t, plain, find(f, c, limit, payloads, true), "%+v: page %d of %d", f, page, limit)
					walked = append(walked, plain...)
					if len(plain) < limit {
						break
					}
					next := plain[len(plain)-1].Cursor()
					c = &next
				}
				require.Equal(t, all, walked, "%+v: pages of %d", f, limit)
			}

			// Cursors that no page returned: at a parked_at many messages
			// share, with a key between theirs, or another consumer.
			for _, c := range []parked.Cursor{
				{ParkedAt: minute(5)},
				{ParkedAt: minute(5), Consumer: f.Consumer},
				{ParkedAt: minute(5), Consumer: f.Consumer, Key: "acme:"},
				{ParkedAt: minute(5), Consumer: f.Consumer, Key: "acme:K"},
				{ParkedAt: minute(5), Consumer: f.Consumer, Key: "globex:z"},
				{ParkedAt: minute(5), Consumer: f.Consumer + "-"},
				{ParkedAt: minute(5), Consumer: "zzz"},
				{ParkedAt: minute(5), Consumer: "A"},
				{ParkedAt: base.Add(-3 * time.Second), Consumer: f.Consumer, Key: "Acme:"},
				{ParkedAt: base.Add(time.Hour)},
			} {
				require.Equal(t, find(f, &c, 5, payloads, false), find(f, &c, 5, payloads, true), "%+v after %+v", f, c)
			}
		}
		require.Equal(t, len(filters)-7-2, nonEmpty, "the filters that match: all but nobody's and the two of times b-incident has none of")
	})
}

// The filters that keysFirst leaves to the plain query: those with a
// condition that has an index of its own (key, message UUID, metadata)
// or none (reason), and those without a consumer.
func TestFindParkedKeysFirstOnlyForTheIndex(t *testing.T) {
	t.Parallel()
	for _, f := range []parked.Filter{
		{},
		{Tenant: "acme", Since: time.Now()},
		{Consumer: "c", Key: "k"},
		{Consumer: "c", MessageUUID: "u"},
		{Consumer: "c", Metadata: map[string]string{"order_id": "1"}},
		{Consumer: "c", Reason: "timeout"},
	} {
		require.False(t, inboxdb.KeysFirst(f), "%+v", f)
	}
}

// On a table of parked messages where one consumer's are all recent (an
// incident: 1,000 of 30,000, in the last 2 days; the others spread over
// 30 days), the first page of that consumer, and of the others, reads the
// consumer's range of the parked_consumer_at index (index only) and then the page's
// rows by the primary key: never the parked_at index with a filter on the
// consumer (which reads the table up to the incident), nor a scan. So do
// the same page within a time range, of a tenant, and after a cursor; and
// so does the generic plan (plan_cache_mode = force_generic_plan), which
// cannot tell a consumer with few recent messages from another.
func TestFindParkedConsumerPlan(t *testing.T) {
	t.Parallel()
	eachLayout(t, func(t *testing.T, layout string) {
		tables := testenv.SchemaLayout(t, layout)
		store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
		require.NoError(t, err)
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		t.Cleanup(cancel)
		b := bundle{ctx: ctx, db: testenv.Drivers(t)[0].DB, tables: tables, store: store}

		// The messages parked before the incident, vacuumed since (as
		// autovacuum does after enough inserts: their pages all-visible),
		// then the incident's, not vacuumed yet. The keys-first plan
		// counts on the former: the planner costs an index-only scan by
		// the share of the table's pages that are all-visible, and with
		// none (a table never vacuumed) it prices the consumer's range of
		// the parked_consumer_at index above a walk of the parked_at index.
		base := time.Now().UTC().Truncate(time.Second)
		park := `INSERT INTO ` + store.ParkedTable() + ` (consumer, message_key, message_uuid, payload, payload_size, metadata, reason, attempts, first_seen_at, parked_at)
SELECT c, (ARRAY['acme:', 'globex:'])[1 + i % 2] || 'key-' || i, 'uuid-' || i, convert_to(repeat('x', 200), 'UTF8'), 200,
  jsonb_build_object('order_id', 'ord-' || i), 'why ' || i, 3, t - interval '1 minute', t
FROM generate_series($2::int, $3::int) i,
  LATERAL (SELECT CASE WHEN i > 29000 THEN 'payments.refund-worker' ELSE 'consumer-' || (i % 5) END AS c,
    CASE WHEN i > 29000 THEN $1::timestamptz - (30000 - i) * interval '150 seconds'
      ELSE $1::timestamptz - interval '30 days' + i * interval '86 seconds' END AS t) x`
		b.exec(t, park, base, 1, 29000)
		vacuumAllVisible(t, b, store.ParkedTable())
		b.exec(t, park, base, 29001, 30000)
		inboxTable := tables.WithDefaults().InboxTable
		index := inboxTable + "_parked_consumer_at"
		walk := regexp.MustCompile(`Index (Only )?Scan( Backward)? using ` + regexp.QuoteMeta(inboxTable+"_parked_at") + `\b`)
		incident := "payments.refund-worker"
		recent := base.Add(-24 * time.Hour)
		for _, c := range []struct {
			name  string
			f     parked.Filter
			after *parked.Cursor
			wantN int
		}{
			{name: "incident", f: parked.Filter{Consumer: incident}, wantN: 51},
			{name: "other consumer", f: parked.Filter{Consumer: "consumer-3"}, wantN: 51},
			{name: "unknown consumer", f: parked.Filter{Consumer: "nobody"}, wantN: 0},
			{name: "incident since", f: parked.Filter{Consumer: incident, Since: recent}, wantN: 51},
			{name: "incident time range", f: parked.Filter{Consumer: incident, Since: recent, Before: base.Add(-12 * time.Hour)}, wantN: 51},
			{name: "tenant", f: parked.Filter{Consumer: incident, Tenant: "globex"}, wantN: 51},
			{name: "cursor", f: parked.Filter{Consumer: incident}, after: &parked.Cursor{ParkedAt: recent, Consumer: incident, Key: "acme:key-29500"}, wantN: 51},
		} {
			query, args, err := store.FindParkedSQL(c.f, c.after, 51, false, inboxdb.KeysFirst(c.f))
			require.NoError(t, err)
			require.True(t, inboxdb.KeysFirst(c.f), c.name)
			rows, err := store.FindParked(ctx, b.db, c.f, c.after, 51, false)
			require.NoError(t, err)
			require.Len(t, rows, c.wantN, c.name)

			custom := testenv.Explain(b.ctx, t, b.db, "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) "+query, args...)
			requireConsumerRange(t, custom, index, walk, store.ParkedTable(), c.name)
			require.NotRegexp(t, `Rows Removed by Filter: [1-9]\d{2,}`, custom, "%s: no node filters out hundreds of rows\n%s", c.name, custom)

			tx := b.begin(t)
			_, err = tx.ExecContext(ctx, "SET LOCAL plan_cache_mode = force_generic_plan")
			require.NoError(t, err)
			_, err = tx.ExecContext(ctx, "PREPARE find_parked AS "+query)
			require.NoError(t, err)
			literals := make([]string, len(args))
			for i, a := range args {
				literals[i] = testenv.SQLLiteral(t, a)
			}
			generic := testenv.Explain(b.ctx, t, tx, "EXPLAIN (COSTS OFF) EXECUTE find_parked("+strings.Join(literals, ", ")+")")
			_, err = tx.ExecContext(ctx, "DEALLOCATE find_parked") // a session's, not the transaction's
			require.NoError(t, err)
			require.NoError(t, tx.Rollback())
			requireConsumerRange(t, generic, index, walk, store.ParkedTable(), c.name+", generic plan")

			if c.name == "incident" {
				plain, plainArgs, err := store.FindParkedSQL(c.f, nil, 51, false, false)
				require.NoError(t, err)
				t.Logf("%s, the page's keys first:\n%s\nthe plain query:\n%s", c.name, custom,
					testenv.Explain(b.ctx, t, b.db, "EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) "+plain, plainArgs...))
			}
		}
	})
}

// vacuumAllVisible vacuums table until its visibility map covers 90% of
// its pages: a transaction of a parallel test that began before the rows
// were written keeps VACUUM from marking their pages all-visible, so it
// runs again once that transaction ended.
func vacuumAllVisible(t *testing.T, b bundle, table string) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		b.exec(t, `VACUUM `+table)
		var visible, pages int64
		require.NoError(t, seam.QueryRow(b.ctx, b.db, `SELECT relallvisible, relpages FROM pg_class WHERE oid = $1::regclass`,
			[]any{table}, &visible, &pages))
		if pages > 0 && visible*10 >= pages*9 {
			return
		}
		require.True(t, time.Now().Before(deadline), "%s: %d of %d pages all-visible after VACUUM for 30 s", table, visible, pages)
		time.Sleep(200 * time.Millisecond)
	}
}

// requireConsumerRange asserts that plan reads the parked messages through
// index and never walks the parked_at index (walk) nor scans the table of
// parked messages, table (the small test inbox may be scanned).
func requireConsumerRange(t *testing.T, plan, index string, walk *regexp.Regexp, table, name string) {
	t.Helper()
	require.Regexp(t, `Index Only Scan using `+regexp.QuoteMeta(index)+`\b`, plan, "%s: the consumer's range of %s\n%s", name, index, plan)
	require.NotRegexp(t, walk, plan, "%s: no walk of the parked_at index\n%s", name, plan)
	unqualified := table[strings.LastIndex(table, ".")+1:]
	require.NotContains(t, plan, "Seq Scan on "+strings.Trim(unqualified, `"`)+" ", "%s\n%s", name, plan)
}
