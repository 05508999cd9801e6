package console

import (
	"context"
	"net/http"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// A relay that wakes on commit is listed whatever its LISTEN connection
// ran last: after 30 s without a notification the relay pings the server
// over it, and the ping is then the session's last statement in
// pg_stat_activity. The test waits for that (polling pg_stat_activity for
// the session, known by an application_name of its own), then asks.
func TestRelaysListedAfterKeepAlivePing(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	app := testenv.Unique(t, "relay_listen_")
	u, err := url.Parse(testenv.DirectDatabaseURL())
	require.NoError(t, err)
	q := u.Query()
	q.Set("application_name", app)
	u.RawQuery = q.Encode()

	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: e.db, Publisher: &recorder{}, PollInterval: time.Second,
		ListenConnString: u.String(), Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Go(func() { _ = relay.Run(ctx) })
	defer func() {
		cancel()
		wg.Wait()
	}()

	var pid int32
	lastIsPing := func() bool {
		err := seam.QueryRow(e.ctx, e.db.Conn, `SELECT coalesce(max(pid), 0) FROM pg_stat_activity WHERE application_name = $1 AND query = '-- ping'`, []any{app}, &pid)
		if err != nil {
			t.Errorf("reading pg_stat_activity: %v", err)
		}
		return pid != 0
	}
	testenv.Eventually(t, 50*time.Second, lastIsPing, "the relay's LISTEN connection pings the server after 30 s without a notification")

	var doc struct {
		Relays []relayInfo `json:"relays"`
	}
	decode(t, e.get("/eo/api/v1/relays"), &doc)
	var found *relayInfo
	for i := range doc.Relays {
		if doc.Relays[i].PID == pid {
			found = &doc.Relays[i]
		}
	}
	require.NotNil(t, found, "the relay's LISTEN session (pid %d, its last statement the ping) is listed: %+v", pid, doc.Relays)
	require.Contains(t, found.BasedOn, basisListen)
	require.Equal(t, app, found.ApplicationName)
}

// On MySQL/MariaDB the list of relays is not available (it reads
// PostgreSQL's pg_locks): the API says so (available false, no channel,
// the note), the overview says "Not available on MySQL." where the table
// was, and neither counts it as an error.
func TestRelaysNotAvailableOnMySQL(t *testing.T) {
	t.Parallel()
	b := testenv.NewBundle(t, testenv.DriverNamed(t, testenv.MariaDB))
	e := newEngineEnv(t, b, func(c *Config) { c.StatsInterval = time.Hour })
	e.row("invoices", "u1", "{}", nil, "")

	var doc struct {
		Available bool        `json:"available"`
		Channel   string      `json:"channel"`
		Relays    []relayInfo `json:"relays"`
		Note      string      `json:"note"`
	}
	decode(t, e.get("/eo/api/v1/relays"), &doc)
	require.False(t, doc.Available)
	require.Empty(t, doc.Channel, "MySQL has no LISTEN")
	require.NotNil(t, doc.Relays, "[] rather than null")
	require.Empty(t, doc.Relays)
	require.Contains(t, doc.Note, "not available on MySQL")

	var ov overviewJSON
	decode(t, e.get("/eo/api/v1/overview"), &ov)
	require.Empty(t, ov.Errors)
	require.Empty(t, ov.Relays)
	require.Contains(t, ov.RelaysNote, "not available on MySQL")
	require.EqualValues(t, 1, ov.Outbox.Pending)

	body := page(t, e.get("/eo/"), http.StatusOK)
	require.Contains(t, body, `<p id="relays-unavailable"><strong>Not available on MySQL.</strong></p>`)
	require.NotContains(t, body, `<table id="relays"`)
	require.NotContains(t, body, "No relay seen.")
	require.NotContains(t, body, `<p class="error">`)
}

// On MySQL/MariaDB the pages name the SQL store "mysql" (its identifier in
// URLs and the API stays "postgres").
func TestPagesNameTheStoreMySQL(t *testing.T) {
	t.Parallel()
	b := testenv.NewBundle(t, testenv.DriverNamed(t, testenv.MariaDB))
	e := newEngineEnv(t, b)
	e.park("charge-order", "o-1", pmsg{topic: "orders", payload: []byte(`{"a":1}`)})
	body := page(t, e.get("/eo/"), http.StatusOK)
	require.Contains(t, body, `data-store="postgres"`)
	require.Contains(t, body, `<td>mysql</td>`)
	body = page(t, e.get("/eo/parked/charge-order/o-1"), http.StatusOK)
	require.Contains(t, body, `<div><dt>Store</dt><dd>mysql</dd></div>`)
	body = page(t, e.get("/eo/inbox?consumer=charge-order&key=o-1"), http.StatusOK)
	require.Contains(t, body, `<div><dt>Store</dt><dd>mysql</dd></div>`)
}
