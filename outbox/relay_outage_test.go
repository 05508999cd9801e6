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
	b := bundle{ctx: ctx, db: testenv.Drivers(t)[0].DB, tables: testenv.Schema(t)}
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

	lines := logs.String()
	errorLines := strings.Count(lines, "ERROR ")
	require.LessOrEqual(t, errorLines, 2, "one line when it starts (per worker at most)\n%s", lines)
	require.GreaterOrEqual(t, errorLines, 1, "the outage is reported\n%s", lines)
	require.Contains(t, lines, "ended after", "and its end\n%s", lines)
}
