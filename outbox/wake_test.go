package outbox_test

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// slowPoll is a poll interval no test waits for: a row relayed within a
// test's deadline was relayed because its commit woke the relay.
const slowPoll = time.Hour

// waitListening waits until relay holds its LISTEN connection.
func waitListening(t *testing.T, relay *outbox.Relay) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, func() bool { return relay.Stats().Listening }, "the relay never listened")
}

// waitDelivered waits until rec has n messages, failing after d.
func waitDelivered(t *testing.T, rec *recorder, n int, d time.Duration, what string) {
	t.Helper()
	testenv.Eventually(t, d, func() bool { return rec.count() >= n }, "%s: %d of %d messages relayed within %s", what, rec.count(), n, d)
}

// With a poll interval of an hour, rows are relayed within a second of
// their commit: spaced commits (each sends a NOTIFY) and back-to-back
// commits (most of their NOTIFYs debounced away, covered by the catch-up
// polls), with both drivers. A rolled-back transaction wakes nothing.
func TestRelayWakesOnCommit(t *testing.T) {
	eachDriver(t, func(t *testing.T, b bundle) {
		rec := &recorder{}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, PollInterval: slowPoll, Logger: testenv.Logger(t),
			ListenConnString: testenv.ListenConnString()})
		require.NoError(t, err)
		runRelay(t, relay)
		waitListening(t, relay)

		for i := range 5 {
			b.publish(t, "spaced", message.NewMessage(fmt.Sprintf("s%d", i), nil))
			waitDelivered(t, rec, i+1, 2*time.Second, "spaced commits")
			time.Sleep(15 * time.Millisecond) // past the writers' debounce
		}
		for i := range 30 {
			b.publish(t, "burst", message.NewMessage(fmt.Sprintf("b%d", i), nil))
		}
		waitDelivered(t, rec, 35, 2*time.Second, "back-to-back commits")

		tx := b.begin(t)
		pub, err := b.w.Publisher(tx)
		require.NoError(t, err)
		require.NoError(t, pub.Publish("rolled-back", message.NewMessage("r", nil)))
		require.NoError(t, tx.Rollback())
		time.Sleep(200 * time.Millisecond)
		require.Equal(t, 35, rec.count())
		require.True(t, relay.Stats().Listening)
	})
}

// Rows committed while the LISTEN connection is down (it was terminated, as
// a database restart or a network cut would) are relayed once it is back,
// without waiting for the poll; the relay says it lost and regained it.
func TestRelayListenReconnects(t *testing.T) {
	eachDriver(t, func(t *testing.T, b bundle) {
		logs := &logCapture{}
		rec := &recorder{}
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: rec, PollInterval: slowPoll,
			ErrorBackoff: 200 * time.Millisecond, Logger: logs, ListenConnString: testenv.ListenConnString(),
		})
		require.NoError(t, err)
		runRelay(t, relay)
		for deadline := time.Now().Add(10 * time.Second); !relay.Stats().Listening; time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("the relay never listened; logs: %s", logs)
			}
		}

		admin := testenv.Pool(t)
		tag, err := admin.Exec(b.ctx, `SELECT pg_terminate_backend(l.pid) FROM pg_locks l WHERE l.locktype = 'advisory' AND l.classid = $2::oid
AND l.objid = to_regclass($1)::oid AND l.objsubid = 1 AND l.granted`, b.tables.Outbox(), uint32(outboxnotify.ListenerLockClass))
		require.NoError(t, err)
		require.EqualValues(t, 1, tag.RowsAffected(), "one LISTEN connection for the table")
		testenv.Eventually(t, 5*time.Second, func() bool { return !relay.Stats().Listening }, "the relay did not notice the lost connection")
		b.publish(t, "t", message.NewMessage("during-outage", nil))

		waitDelivered(t, rec, 1, 5*time.Second, "a row committed while LISTEN was down")
		waitListening(t, relay)
		b.publish(t, "t", message.NewMessage("after", nil))
		waitDelivered(t, rec, 2, 2*time.Second, "a row committed after the reconnection")
		require.True(t, logs.has("the LISTEN connection failed"), "logs: %s", logs)
		require.True(t, logs.has("wake-on-commit is back"), "logs: %s", logs)
	})
}

// Behind PgBouncer in transaction mode LISTEN does not hold: the relay sees
// the pooler, says wake-on-commit is off and why, and polls. Given a direct
// ListenConnString, it wakes on commit while its transactions still go
// through PgBouncer.
func TestRelayBehindPgBouncer(t *testing.T) {
	bouncer := testenv.PgBouncer(t, "transaction")
	pool := testenv.PoolFor(t, bouncer)
	tables := testenv.Schema(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b := newBundle(t, ctx, testenv.Drivers(t)[0].DB, tables)
	viaBouncer := testenv.WithConn(tables, wsql.BeginnerFromPgx(pool))

	t.Run("polls", func(t *testing.T) {
		logs := &logCapture{}
		rec := &recorder{}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: viaBouncer, Publisher: rec, PollInterval: 50 * time.Millisecond, Logger: logs})
		require.NoError(t, err)
		stop := runRelay(t, relay)
		defer stop()
		testenv.Eventually(t, 10*time.Second, func() bool { return logs.has("wake-on-commit is off") }, "no log line saying wake-on-commit is off; logs: %s", logs)
		require.True(t, logs.has("connection pooler"), "logs: %s", logs)
		b.publish(t, "t", message.NewMessage("p1", nil))
		waitDelivered(t, rec, 1, 5*time.Second, "polling behind PgBouncer")
		require.False(t, relay.Stats().Listening)
		require.Empty(t, listenerApps(t, b), "no session is marked as a relay's LISTEN session (none listens)")
	})
	t.Run("direct listen", func(t *testing.T) {
		rec := &recorder{}
		app := testenv.Unique(t, "direct_listen_")
		u, err := url.Parse(testenv.DirectDatabaseURL())
		require.NoError(t, err)
		q := u.Query()
		q.Set("application_name", app)
		u.RawQuery = q.Encode()
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: viaBouncer, Publisher: rec, PollInterval: slowPoll,
			ListenConnString: u.String(), Logger: testenv.Logger(t),
		})
		require.NoError(t, err)
		stop := runRelay(t, relay)
		defer stop()
		waitListening(t, relay)
		before := rec.count()
		b.publish(t, "t", message.NewMessage("d1", nil))
		waitDelivered(t, rec, before+1, 2*time.Second, "waking through a direct LISTEN")
		require.Equal(t, []string{app}, listenerApps(t, b), "the lock that marks the LISTEN session is on the direct connection that LISTENs")
	})
}

// listenerApps returns the application_name of each session holding the
// lock that marks a relay's LISTEN session for b's outbox table.
func listenerApps(t *testing.T, b bundle) []string {
	t.Helper()
	rows, err := b.db.QueryContext(b.ctx, `SELECT a.application_name FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid
WHERE l.locktype = 'advisory' AND l.classid = $2::oid AND l.objid = to_regclass($1)::oid AND l.objsubid = 1 AND l.granted
ORDER BY 1`, b.tables.Outbox(), uint32(outboxnotify.ListenerLockClass))
	require.NoError(t, err)
	var apps []string
	for rows.Next() {
		var app string
		require.NoError(t, rows.Scan(&app))
		apps = append(apps, app)
	}
	require.NoError(t, seam.Close(rows))
	return apps
}

// NoListen: the relay opens no connection of its own and only polls.
func TestRelayNoListen(t *testing.T) {
	eachDriver(t, func(t *testing.T, b bundle) {
		rec := &recorder{}
		relay, err := outbox.NewRelay(outbox.RelayConfig{DB: b.schema(), Publisher: rec, PollInterval: 100 * time.Millisecond, NoListen: true, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		runRelay(t, relay)
		b.publish(t, "t", message.NewMessage("n1", nil))
		waitDelivered(t, rec, 1, 5*time.Second, "polling")
		require.False(t, relay.Stats().Listening)
		n := testenv.Count(t, b.db, `SELECT count(*) FROM pg_stat_activity a WHERE a.query = 'LISTEN "`+outbox.ChannelName(b.tables)+`"'
OR EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.classid = $2::oid
    AND l.objid = to_regclass($1)::oid AND l.objsubid = 1 AND l.granted)`, b.tables.Outbox(), uint32(outboxnotify.ListenerLockClass))
		require.Zero(t, n, "no LISTEN session")
	})
}

// logCapture is a watermill logger that keeps its lines.
type logCapture struct{ buf syncBuffer }

func (l *logCapture) log(level, msg string, err error, fields watermill.LogFields) {
	line := level + " " + msg
	if err != nil {
		line += ": " + err.Error()
	}
	_, _ = fmt.Fprintf(&l.buf, "%s %v\n", line, fields)
}
func (l *logCapture) Error(msg string, err error, f watermill.LogFields) { l.log("ERROR", msg, err, f) }
func (l *logCapture) Info(msg string, f watermill.LogFields)             { l.log("INFO", msg, nil, f) }
func (l *logCapture) Debug(msg string, f watermill.LogFields)            {}
func (l *logCapture) Trace(msg string, f watermill.LogFields)            {}
func (l *logCapture) With(watermill.LogFields) watermill.LoggerAdapter   { return l }
func (l *logCapture) has(s string) bool                                  { return strings.Contains(l.buf.String(), s) }
func (l *logCapture) String() string                                     { return l.buf.String() }

// A LISTEN connection that dies without a word (a partition leaving both
// TCP ends open: nothing arrives, nothing is refused) is found by the ping
// after a silent interval and replaced: rows committed meanwhile are
// relayed without waiting for the poll. The relay's ping interval and
// timeout are shortened to 300 ms.
func TestRelayListenSilentConnectionIsReplaced(t *testing.T) {
	proxy := testenv.NewProxy(t, hostPort(t, testenv.DirectDatabaseURL()))
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b := newBundle(t, ctx, testenv.Drivers(t)[0].DB, testenv.Schema(t))
	logs := &logCapture{}
	rec := &recorder{}
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		DB: b.schema(), Publisher: rec, PollInterval: slowPoll, ErrorBackoff: 100 * time.Millisecond,
		ListenConnString: proxy.RewriteURL(testenv.DirectDatabaseURL()), Logger: logs,
	})
	require.NoError(t, err)
	outbox.SetListenPing(relay, 300*time.Millisecond, 300*time.Millisecond)
	runRelay(t, relay)
	waitListening(t, relay)

	proxy.Blackhole()
	b.publish(t, "t", message.NewMessage("during-partition", nil))
	testenv.Eventually(t, 10*time.Second, func() bool { return logs.has("did not answer a ping") }, "the silent LISTEN connection was never found out")
	proxy.Allow()
	waitDelivered(t, rec, 1, 10*time.Second, "a row committed while the LISTEN connection was silent")
	waitListening(t, relay)
	b.publish(t, "t", message.NewMessage("after", nil))
	waitDelivered(t, rec, 2, 2*time.Second, "a row committed after the new LISTEN connection")
}

// hostPort is the host:port of a PostgreSQL URL.
func hostPort(t *testing.T, rawURL string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	require.NoError(t, err)
	return u.Host
}
