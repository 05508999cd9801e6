package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// insertParkedMessage writes the message a key was parked with into the
// inbox's table of parked messages, as the middleware would have.
func insertParkedMessage(t *testing.T, db sqlschema.DB, consumer, key string) {
	t.Helper()
	db = db.WithDefaults()
	if db.Dialect == sqlschema.MySQL {
		_, err := db.Conn.ExecContext(testCtx(t), `INSERT INTO `+db.Dialect.QuoteIdentifier(db.Schema, db.InboxTable+"_parked")+`
 (consumer, message_key, message_uuid, topic, payload, payload_size, metadata, reason, attempts, first_seen_at, parked_at)
 VALUES (?, ?, ?, 'orders', '{}', 2, '{}', 'card declined', 1, UTC_TIMESTAMP(6) - INTERVAL 1 HOUR, UTC_TIMESTAMP(6))`, consumer, key, key)
		require.NoError(t, err)
		return
	}
	_, err := db.Conn.ExecContext(testCtx(t), `INSERT INTO `+pgx.Identifier{db.Schema, db.InboxTable + "_parked"}.Sanitize()+`
 (consumer, message_key, message_uuid, topic, payload, payload_size, reason, attempts, first_seen_at)
 VALUES ($1, $2, $2, 'orders', '{}'::bytea, 2, 'card declined', 1, now() - interval '1 hour')`, consumer, key)
	require.NoError(t, err)
}

// A consumer that has no record in the inbox (nor a parked message): a
// misspelled name. Every command that takes a consumer says so, with the
// consumers that have records, and exits with status 3, instead of
// reporting an empty result ("No parked keys.") with status 0. A consumer
// that has records but nothing parked still gets the empty result.
func TestUnknownConsumer(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testUnknownConsumer)
}

func testUnknownConsumer(t *testing.T, b *testenv.Bundle) {
	db := b.DB.WithDefaults()
	env := engineEnv(b)
	insertInbox(t, db,
		inboxRow{consumer: "charge-order", key: "o-1", status: "parked", attempts: 1, firstSeenAgo: time.Hour, finishedAgo: time.Hour, lastError: "card declined"},
		inboxRow{consumer: "send-sms", key: "s-1", status: "done", attempts: 1, firstSeenAgo: time.Hour, finishedAgo: time.Hour},
	)
	insertParkedMessage(t, db, "charge-order", "o-1")
	// A released key's record was purged; its parked message stays until
	// replayed or discarded: the consumer is known.
	insertParkedMessage(t, db, "released", "r-1")

	want := `unknown consumer "charge_order": no records in inbox table ` + db.Inbox() + `; consumers with records: charge-order, released, send-sms`
	for _, args := range [][]string{
		{"inbox", "parked", "-c", "charge_order"},
		{"inbox", "parked", "--json", "--consumer", "charge_order"},
		{"inbox", "stats", "-c", "charge_order"},
		{"inbox", "stats", "-c", "charge_order", "--tenant", "acme"},
		{"inbox", "show", "-c", "charge_order", "o-1"},
		{"inbox", "forget", "-c", "charge_order", "o-1"},
		{"inbox", "release", "-c", "charge_order", "o-1"},
		{"parked", "list", "-c", "charge_order"},
		{"parked", "list", "--json", "-c", "charge_order", "--reason", "declined"},
		{"parked", "show", "charge_order", "o-1"},
		{"parked", "replay", "charge_order", "o-1"},
		{"parked", "replay", "-c", "charge_order"},
		{"parked", "replay", "-c", "charge_order", "--yes"},
		{"parked", "discard", "charge_order", "o-1"},
		{"parked", "discard", "-c", "charge_order", "--yes"},
		{"parked", "release", "charge_order", "o-1"},
	} {
		requireFails(t, cli(t, env, args...), exitNotFound, want)
	}

	// A purge is a note, not a failure: a scheduled purge of an idle
	// consumer (whose records an earlier run removed) must keep working.
	r := cli(t, env, "inbox", "purge", "--older-than", "30d", "-c", "charge_order")
	requireOK(t, r)
	require.Contains(t, r.stderr, "note: "+want)

	// Known consumers: the empty results of before.
	r = cli(t, env, "inbox", "parked", "-c", "send-sms")
	requireOK(t, r)
	require.Equal(t, "No parked keys.\n", r.stdout)
	r = cli(t, env, "inbox", "parked", "-c", "released")
	requireOK(t, r)
	require.Equal(t, "No parked keys.\n", r.stdout, "known by its parked message")
	r = cli(t, env, "parked", "list", "-c", "send-sms")
	requireOK(t, r)
	require.Equal(t, "No parked messages (inbox "+db.Schema+".watermill_inbox).\n", r.stdout)
	var list parkedListJSON
	decode(t, cli(t, env, "parked", "list", "--json", "-c", "released"), &list)
	require.Len(t, list.Messages, 1)
	r = cli(t, env, "parked", "replay", "-c", "send-sms")
	requireOK(t, r)
	require.Equal(t, "0 messages match. Nothing done: the same command with --yes will replay them.\n", r.stdout)
	requireOK(t, cli(t, env, "inbox", "stats", "-c", "send-sms"))
	requireOK(t, cli(t, env, "inbox", "purge", "--older-than", "30d", "-c", "send-sms"))
	requireFails(t, cli(t, env, "inbox", "show", "-c", "send-sms", "nope"), exitNotFound, `no inbox record for consumer "send-sms", key "nope"`)
	requireExit(t, cli(t, env, "parked", "show", "send-sms", "s-1"), exitNotFound, "parked show")
	requireExit(t, cli(t, env, "parked", "release", "send-sms", "s-1"), exitNotFound, `parked release: "s-1" for "send-sms" is not parked`)
	requireOK(t, cli(t, env, "inbox", "parked", "-c", "charge-order"))

	// Many consumers: the first 20, and how many more.
	manyB := testenv.NewBundle(t, b.Driver)
	many := manyB.DB.WithDefaults()
	var names []string
	for i := range 25 {
		name := fmt.Sprintf("c%02d", i)
		names = append(names, name)
		insertInbox(t, many, inboxRow{consumer: name, key: "k", status: "done", attempts: 1, firstSeenAgo: time.Minute, finishedAgo: time.Minute})
	}
	requireFails(t, cli(t, engineEnv(manyB), "inbox", "parked", "-c", "c99"), exitNotFound,
		`unknown consumer "c99": no records in inbox table `+many.Inbox()+`; consumers with records: `+strings.Join(names[:20], ", ")+" and 5 more")

	// An empty inbox.
	emptyB := testenv.NewBundle(t, b.Driver)
	requireFails(t, cli(t, engineEnv(emptyB), "parked", "list", "-c", "charge-order"), exitNotFound,
		`unknown consumer "charge-order": no records in inbox table `+emptyB.DB.WithDefaults().Inbox()+`; no consumer has records`)
}

// An unknown consumer on a large inbox, plain or partitioned: the error
// lists the consumers that have records. The look-ups' plans (index
// look-ups, never a scan of the records) are tested with
// inbox.Store.HasConsumer and Consumers, which the command calls.
func TestUnknownConsumerPlans(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	for _, layout := range testenv.Layouts {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			db := testenv.SchemaLayout(t, layout).WithDefaults()
			ctx := testCtx(t)
			_, err := db.Conn.ExecContext(ctx, `INSERT INTO `+db.Inbox()+` (consumer, message_key, status, processed_at)
 SELECT (ARRAY['charge-order', 'send-sms', 'ship-order'])[1 + i % 3], 'k' || i, 'done', now() FROM generate_series(1, 20000) i`)
			require.NoError(t, err)
			insertParkedMessage(t, db, "ship-order", "k3")
			requireFails(t, cli(t, dbEnv(db.Schema), "inbox", "stats", "-c", "charge_order", "--partitions", map[string]string{"plain": "", "partitioned": "daily"}[layout]), exitNotFound,
				`unknown consumer "charge_order": no records in inbox table "`+db.Schema+`"."watermill_inbox"; consumers with records: charge-order, send-sms, ship-order`)
		})
	}
}

// The Redis store keeps no list of its consumers (finding one's records
// would scan the whole keyspace): there an unknown consumer finds nothing,
// as before, and no error is made up.
func TestUnknownConsumerRedis(t *testing.T) {
	t.Parallel()
	rdb := testenv.Redis(t)
	env := []string{"REDIS_URL=" + testenv.RedisURL(), envRedisPrefix + "=" + testenv.RedisPrefix(t, rdb)}
	r := cli(t, env, "parked", "list", "--redis-url", "", "-c", "charge_order")
	requireOK(t, r)
	require.True(t, strings.HasPrefix(r.stdout, "No parked messages (Redis "), "%s", r)
}
