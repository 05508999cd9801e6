package metrics_test

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/metrics"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// TestNewWatchesOutboxAndRelays: Config.Outbox and Config.Relays make New
// watch them, as WatchOutbox and WatchRelay do: the outbox backlog and the
// relay's counters are in the registry's scrape (gathered, and served by
// promhttp) from the first one; a Config whose watch New refuses leaves
// the registry empty.
func TestNewWatchesOutboxAndRelays(t *testing.T) {
	t.Parallel()
	db := testenv.Schema(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: &flaky{}, Logger: watermill.NopLogger{}})
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	_, err = metrics.New(metrics.Config{Registerer: reg, Outbox: db, Relays: []*outbox.Relay{relay}})
	require.NoError(t, err)

	writeOutbox(t, ctx, db, "ok", "w-1", "w-2")
	s := scrape(t, reg)
	require.Equal(t, float64(2), s["exactlyonce_outbox_pending_rows"], "the outbox is watched")
	require.Equal(t, float64(0), s["exactlyonce_relay_relayed_total"], "the relay is watched")

	n, err := relay.Flush(ctx)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	s = scrape(t, reg)
	require.Equal(t, float64(0), s["exactlyonce_outbox_pending_rows"])
	require.Equal(t, float64(2), s["exactlyonce_relay_relayed_total"])

	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	res, err := http.Get(srv.URL)
	require.NoError(t, err)
	body, err := io.ReadAll(res.Body)
	require.NoError(t, res.Body.Close())
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, res.StatusCode)
	require.Contains(t, string(body), "\nexactlyonce_relay_relayed_total 2\n")
	require.Contains(t, string(body), "\nexactlyonce_outbox_pending_rows 0\n")

	// A watch New refuses: an error naming the field, and nothing registered.
	empty := prometheus.NewPedanticRegistry()
	_, err = metrics.New(metrics.Config{Registerer: empty, Relays: []*outbox.Relay{relay, nil}})
	require.ErrorContains(t, err, "Config.Relays[1] is nil")
	_, err = metrics.New(metrics.Config{Registerer: empty, Outbox: sqlschema.DB{Schema: db.Schema}})
	require.ErrorContains(t, err, "Config.Outbox")
	mfs, err := empty.Gather()
	require.NoError(t, err)
	require.Empty(t, mfs, "a refused Config registers nothing")
	_, err = metrics.New(metrics.Config{Registerer: empty})
	require.NoError(t, err, "the registry is still free")

	// Without them, nothing is watched: no outbox or relay series.
	none := prometheus.NewPedanticRegistry()
	_, err = metrics.New(metrics.Config{Registerer: none})
	require.NoError(t, err)
	require.Empty(t, withPrefix(scrape(t, none), "exactlyonce_outbox_", "exactlyonce_relay_"))
}
