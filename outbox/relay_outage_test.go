package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// A 10 s database outage is a few log lines from the relay (it started,
// and ended with its length and count), not one per failed batch, and the
// relay catches up after it.
// Before: a "batch failed, will retry" ERROR line per failed batch.
func TestRelayOutageIsAFewLines(t *testing.T) {
	t.Parallel()
	proxy := testenv.NewProxy(t, hostPort(t, testenv.DirectDatabaseURL()))
	pool := testenv.PoolFor(t, proxy.RewriteURL(testenv.DirectDatabaseURL()))
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	b := newBundle(t, ctx, testenv.Drivers(t)[0].DB, testenv.Schema(t))
	logs := &logCapture{}
	rec := &recorder{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		DB: testenv.WithConn(b.tables, wsql.BeginnerFromPgx(pool)), Publisher: rec, NoListen: true,
		PollInterval: 50 * time.Millisecond, ErrorBackoff: 50 * time.Millisecond, MaxErrorBackoff: 400 * time.Millisecond,
		Workers: 2, Logger: logs,
	})
	require.NoError(t, err)
	runRelay(t, relay)
	b.publish(t, "t", message.NewMessage("before", nil))
	waitDelivered(t, rec, 1, 10*time.Second, "before the outage")

	proxy.Refuse()
	time.Sleep(10 * time.Second)
	b.publish(t, "t", message.NewMessage("during", nil)) // written directly, not through the proxy
	proxy.Allow()
	waitDelivered(t, rec, 2, 10*time.Second, "after the outage")

	// The episode ends at a successful batch once no failure was seen for 5 s.
	testenv.Eventually(t, 20*time.Second, func() bool { return logs.has("ended after") }, "the outage's end is logged\n%s", logs)
	lines := logs.String()
	errorLines := strings.Count(lines, "ERROR ")
	require.LessOrEqual(t, errorLines, 2, "one line when it starts (per worker at most)\n%s", lines)
	require.GreaterOrEqual(t, errorLines, 1, "the outage is reported\n%s", lines)
	require.Contains(t, lines, "ended after", "and its end\n%s", lines)
}

// The relay's start-up check against the database: a migrated outbox
// table is reported as such; one whose migrations are not recorded (made
// by another tool from sqlschema.SQL, or not migrated) is reported as not
// checked, before any row. (A table migrated by an earlier version of the
// library, some migrations missing: TestMigrationVerdict.)
// Before: nothing was checked unless the service called sqlschema.Check.
func TestRelayStartupCheck(t *testing.T) {
	t.Parallel()
	for _, recorded := range []bool{false, true} {
		t.Run(map[bool]string{false: "none recorded", true: "migrated"}[recorded], func(t *testing.T) {
			t.Parallel()
			testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
				db := b.DB
				if !recorded {
					b.Exec(t, "DELETE FROM "+b.Table("watermill_exactlyonce_migrations")+" WHERE target LIKE 'outbox:%'")
				}
				logs := &logCapture{}
				relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: &recorder{}, NoListen: true, Logger: logs})
				require.NoError(t, err)
				runRelay(t, relay)
				if !recorded {
					testenv.Eventually(t, 10*time.Second, func() bool {
						return logs.has("INFO outbox relay: start-up check: no migration is recorded for the outbox table")
					}, "the unchecked table is reported\n%s", logs)
					require.NotContains(t, logs.String(), "ERROR")
					return
				}
				testenv.Eventually(t, 10*time.Second, func() bool { return logs.has("INFO outbox relay: start-up check passed") }, "the check passes\n%s", logs)
				require.NotContains(t, logs.String(), "ERROR")
			})
		})
	}
}
