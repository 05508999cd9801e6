package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// --tenant selects the keys of one tenant (exactlyonce.KeyByTenant): stats
// count them, KEY is the key within the tenant, purge leaves the other
// tenants' records; a tenant with a colon is a usage error.
func TestInboxTenant(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testInboxTenant)
}

func testInboxTenant(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	env := engineEnv(b)
	day := 24 * time.Hour
	insertInbox(t, db,
		inboxRow{consumer: "billing", key: "acme:inv-1", status: "done", attempts: 1, firstSeenAgo: 40 * day, finishedAgo: 40 * day},
		inboxRow{consumer: "billing", key: "acme:inv-2", status: "done", attempts: 1, firstSeenAgo: 40 * day, finishedAgo: 40 * day},
		inboxRow{consumer: "billing", key: "acme2:inv-1", status: "done", attempts: 1, firstSeenAgo: 40 * day, finishedAgo: 40 * day},
		inboxRow{consumer: "billing", key: "mallory:inv-1", status: "parked", attempts: 1, firstSeenAgo: 40 * day, finishedAgo: 40 * day, lastError: "x"},
	)
	var st struct {
		inboxStatsJSON
		Tenant string `json:"tenant"`
	}
	decode(t, cli(t, env, "inbox", "stats", "--json", "--tenant", "acme"), &st)
	require.Equal(t, "acme", st.Tenant)
	require.Equal(t, int64(2), st.Total)

	var rec recordJSON
	decode(t, cli(t, env, "inbox", "show", "--json", "-c", "billing", "--tenant", "mallory", "inv-1"), &rec)
	require.Equal(t, "mallory:inv-1", rec.Key)
	requireOK(t, cli(t, env, "inbox", "release", "-c", "billing", "--tenant", "mallory", "inv-1"))
	requireExit(t, cli(t, env, "inbox", "show", "-c", "billing", "--tenant", "a:b", "inv-1"), exitUsage, `contains ":"`)
	requireExit(t, cli(t, env, "inbox", "stats", "--tenant", "a:b"), exitUsage, `contains ":"`)

	r := cli(t, env, "inbox", "purge", "--older-than", "30d", "--tenant", "acme")
	requireOK(t, r)
	store, err := inbox.NewStore(db)
	require.NoError(t, err)
	all, err := store.Stats(testCtx(t), "")
	require.NoError(t, err)
	require.Equal(t, int64(2), all.Total, "acme2's and mallory's records are left\n%s", r)
}

// --partitions states the partitioned layout as the service's
// sqlschema.DB.Partitions does: migrate up creates the partitioned inbox,
// and the commands work on it.
func TestPartitionedLayout(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	schema := freshSchema(t)
	env := dbEnv(schema)
	requireOK(t, cli(t, env, "migrate", "up", "--partitions", "daily"))
	n := testenv.Count(t, testenv.Drivers(t)[0].DB,
		`SELECT count(*) FROM pg_partitioned_table p JOIN pg_class c ON c.oid = p.partrelid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1`, schema)
	require.Equal(t, int64(1), n, "the inbox is partitioned")
	requireOK(t, cli(t, append(env, envPartitions+"=daily"), "inbox", "stats"))
	requireOK(t, cli(t, env, "inbox", "purge", "--partitions", "daily", "--older-than", "30d"))
	requireExit(t, cli(t, env, "inbox", "stats", "--partitions", "weekly"), exitUsage, `--partitions is "weekly"`)
}
