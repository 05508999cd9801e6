package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// inboxRow is a record written straight into a migrated inbox table, as the
// middleware would have left it.
type inboxRow struct {
	consumer, key, status string
	attempts              int
	duplicates            int64
	firstSeenAgo          time.Duration
	finishedAgo           time.Duration // processed_at; 0: NULL
	lastError             string
}

func insertInbox(t *testing.T, db sqlschema.DB, rows ...inboxRow) {
	t.Helper()
	for _, r := range rows {
		var processed *float64
		if r.finishedAgo != 0 {
			secs := r.finishedAgo.Seconds()
			processed = &secs
		}
		var lastErr *string
		if r.lastError != "" {
			lastErr = &r.lastError
		}
		if db.Dialect == sqlschema.MySQL {
			var processedUS *int64
			if processed != nil {
				us := r.finishedAgo.Microseconds()
				processedUS = &us
			}
			_, err := db.Conn.ExecContext(testCtx(t), `INSERT INTO `+db.Inbox()+`
 (consumer, message_key, status, attempts, duplicates, first_seen_at, processed_at, last_error, parked_by_transaction)
 VALUES (?, ?, ?, ?, ?, UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND, UTC_TIMESTAMP(6) - INTERVAL ? MICROSECOND, ?, ?)`,
				r.consumer, r.key, r.status, r.attempts, r.duplicates, r.firstSeenAgo.Microseconds(), processedUS, lastErr, r.status == "parked")
			require.NoError(t, err)
			continue
		}
		_, err := db.Conn.ExecContext(testCtx(t), `INSERT INTO `+db.Inbox()+`
 (consumer, message_key, status, attempts, duplicates, first_seen_at, processed_at, last_error, parked_by_transaction)
 VALUES ($1, $2, $3, $4, $5, now() - $6::float8 * interval '1 second', now() - $7::float8 * interval '1 second', $8, $3 = 'parked')`,
			r.consumer, r.key, r.status, r.attempts, r.duplicates, r.firstSeenAgo.Seconds(), processed, lastErr)
		require.NoError(t, err)
	}
}

type inboxStatsJSON struct {
	Consumer        string           `json:"consumer"`
	Total           int64            `json:"total"`
	Rows            map[string]int64 `json:"rows"`
	Duplicates      int64            `json:"duplicates"`
	OldestFirstSeen *string          `json:"oldest_first_seen_at"`
}

// Every inbox command on real records in a migrated schema: what it prints,
// in text and JSON, what it changes (read back through inbox.Store), and
// exit status 3 for keys that have no record.
func TestInboxCommands(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testInboxCommands)
}

func testInboxCommands(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	env := engineEnv(b)
	store, err := inbox.NewStore(db)
	require.NoError(t, err)
	day := 24 * time.Hour
	insertInbox(t, db,
		inboxRow{consumer: "orders", key: "old-1", status: "done", attempts: 1, duplicates: 2, firstSeenAgo: 40 * day, finishedAgo: 40 * day},
		inboxRow{consumer: "orders", key: "old-2", status: "done", attempts: 1, firstSeenAgo: 35 * day, finishedAgo: 35 * day},
		inboxRow{consumer: "orders", key: "new", status: "done", attempts: 1, duplicates: 1, firstSeenAgo: time.Hour, finishedAgo: time.Hour},
		inboxRow{consumer: "orders", key: "stuck", status: "parked", attempts: 3, firstSeenAgo: 50 * day, finishedAgo: 45 * day, lastError: "provider: invalid phone number"},
		inboxRow{consumer: "orders", key: "-dash", status: "done", attempts: 1, firstSeenAgo: time.Minute, finishedAgo: time.Minute},
		inboxRow{consumer: "mail", key: "m1", status: "failed", attempts: 2, firstSeenAgo: 2 * time.Hour, finishedAgo: time.Hour, lastError: "smtp 451"},
	)

	// stats
	var st inboxStatsJSON
	decode(t, cli(t, env, "inbox", "stats", "--json"), &st)
	require.Equal(t, inboxStatsJSON{Consumer: "", Total: 6, Rows: map[string]int64{"done": 4, "processing": 0, "failed": 1, "parked": 1, "discarded": 0},
		Duplicates: 3, OldestFirstSeen: st.OldestFirstSeen}, st)
	require.NotNil(t, st.OldestFirstSeen)
	oldest, err := time.Parse(time.RFC3339Nano, *st.OldestFirstSeen)
	require.NoError(t, err)
	require.WithinDuration(t, time.Now().Add(-50*day), oldest, time.Minute)
	decode(t, cli(t, env, "inbox", "stats", "--json", "--consumer", "mail"), &st)
	require.Equal(t, "mail", st.Consumer)
	require.Equal(t, int64(1), st.Total)
	r := cli(t, env, "inbox", "stats", "-c", "orders")
	requireOK(t, r)
	require.Regexp(t, `records +5\n`, r.stdout)
	require.Regexp(t, `parked +1\n`, r.stdout)
	require.Contains(t, r.stdout, "exactlyonce inbox parked")

	// show
	var rec recordJSON
	decode(t, cli(t, env, "inbox", "show", "--json", "-c", "orders", "stuck"), &rec)
	require.Equal(t, "orders", rec.Consumer)
	require.Equal(t, "stuck", rec.Key)
	require.Equal(t, "parked", rec.Status)
	require.Equal(t, 3, rec.Attempts)
	require.Equal(t, "provider: invalid phone number", rec.LastError)
	require.NotNil(t, rec.FirstSeenAt)
	require.NotNil(t, rec.ProcessedAt)
	require.Nil(t, rec.LeaseUntil)
	r = cli(t, env, "inbox", "show", "--consumer", "orders", "stuck")
	requireOK(t, r)
	require.Regexp(t, `status +parked\n`, r.stdout)
	require.Regexp(t, `last error +provider: invalid phone number\n`, r.stdout)
	require.Contains(t, r.stdout, "exactlyonce inbox release -c orders stuck")
	r = cli(t, env, "inbox", "show", "-c", "orders", "--", "-dash")
	requireOK(t, r)
	require.Regexp(t, `key +-dash\n`, r.stdout)
	requireExit(t, cli(t, env, "inbox", "show", "-c", "orders", "missing"), exitNotFound, `no inbox record for consumer "orders", key "missing"`)
	requireExit(t, cli(t, env, "inbox", "show", "--json", "-c", "mail", "stuck"), exitNotFound, "no inbox record")

	// parked
	var parked struct {
		Consumer string       `json:"consumer"`
		Count    int          `json:"count"`
		Limit    int          `json:"limit"`
		Records  []recordJSON `json:"records"`
	}
	decode(t, cli(t, env, "inbox", "parked", "--json"), &parked)
	require.Equal(t, 1, parked.Count)
	require.Equal(t, 100, parked.Limit)
	require.Equal(t, "stuck", parked.Records[0].Key)
	require.Equal(t, "provider: invalid phone number", parked.Records[0].LastError)
	decode(t, cli(t, env, "inbox", "parked", "--json", "-c", "mail"), &parked)
	require.Zero(t, parked.Count)
	require.NotNil(t, parked.Records, "[] rather than null")
	r = cli(t, env, "inbox", "parked")
	requireOK(t, r)
	require.Regexp(t, `orders +stuck +3 +45d ago +provider: invalid phone number\n`, r.stdout)
	r = cli(t, env, "inbox", "parked", "-c", "mail")
	requireOK(t, r)
	require.Equal(t, "No parked keys.\n", r.stdout)

	// release: only a parked key
	requireExit(t, cli(t, env, "inbox", "release", "-c", "orders", "new"), exitNotFound, `key "new" is done, not parked`)
	requireExit(t, cli(t, env, "inbox", "release", "-c", "orders", "missing"), exitNotFound, "no inbox record")
	var released struct {
		Consumer string `json:"consumer"`
		Key      string `json:"key"`
		Released bool   `json:"released"`
	}
	decode(t, cli(t, env, "inbox", "release", "--json", "-c", "orders", "stuck"), &released)
	require.True(t, released.Released)
	got, err := store.Get(testCtx(t), "orders", "stuck")
	require.NoError(t, err)
	require.Equal(t, "failed", got.Status, "released: the next delivery runs again")
	requireExit(t, cli(t, env, "inbox", "release", "-c", "orders", "stuck"), exitNotFound, "is failed, not parked")

	// forget
	r = cli(t, env, "inbox", "forget", "-c", "orders", "new")
	requireOK(t, r)
	require.Contains(t, r.stdout, `Forgot consumer "orders", key "new"`)
	_, err = store.Get(testCtx(t), "orders", "new")
	require.ErrorIs(t, err, inbox.ErrNotFound)
	requireExit(t, cli(t, env, "inbox", "forget", "-c", "orders", "new"), exitNotFound, "nothing to forget")
	var forgot struct {
		Consumer  string `json:"consumer"`
		Key       string `json:"key"`
		Forgotten bool   `json:"forgotten"`
	}
	decode(t, cli(t, env, "inbox", "forget", "--json", "-c", "orders", "--", "-dash"), &forgot)
	require.Equal(t, "-dash", forgot.Key)
	require.True(t, forgot.Forgotten)

	// purge: done and failed records that finished more than 30 days ago,
	// never the parked one (released just now, so it is young anyway).
	var purged struct {
		Consumer  string  `json:"consumer"`
		OlderThan string  `json:"older_than"`
		Deleted   int64   `json:"deleted"`
		Complete  bool    `json:"complete"`
		Seconds   float64 `json:"seconds"`
	}
	decode(t, cli(t, env, "inbox", "purge", "--json", "--older-than", "30d", "-c", "mail"), &purged)
	require.Zero(t, purged.Deleted, "mail's record is young")
	decode(t, cli(t, env, "inbox", "purge", "--json", "--older-than", "30d", "--batch-size", "1"), &purged)
	require.Equal(t, int64(2), purged.Deleted)
	require.True(t, purged.Complete)
	require.Equal(t, "720h0m0s", purged.OlderThan)
	for _, key := range []string{"old-1", "old-2"} {
		_, err = store.Get(testCtx(t), "orders", key)
		require.ErrorIs(t, err, inbox.ErrNotFound, key)
	}
	r = cli(t, env, "inbox", "purge", "--older-than", "1d12h")
	requireOK(t, r)
	require.Contains(t, r.stdout, "Purged 0 records that finished more than 1d12h ago")
	decode(t, cli(t, env, "inbox", "stats", "--json"), &st)
	require.Equal(t, map[string]int64{"done": 0, "processing": 0, "failed": 2, "parked": 0, "discarded": 0}, st.Rows)
}
