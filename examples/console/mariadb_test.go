package main

import (
	"context"
	"net/http/httptest"
	"os"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// The console in a headless Chromium over a MariaDB-backed inbox and
// outbox: after signing in, the overview shows the consumer's parked
// message (its store named mysql, also after the page's script redrew the
// table) and the outbox's backlog, no error, and "Not available on
// MySQL." where PostgreSQL's list of relays would be; the parked message's
// page shows its payload. It writes console-mariadb.png when
// CONSOLE_SCREENSHOTS names a directory.
func TestConsoleInBrowserMariaDB(t *testing.T) {
	chromium, err := chromiumPath()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	bundle := testenv.NewBundle(t, testenv.DriverNamed(t, testenv.MariaDB))
	db := bundle.DB
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)

	inner, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	require.NoError(t, err)
	require.NoError(t, inner.Park(ctx, db.Conn, consumer, "uuid-A-1042", "payment provider refused order A-1042: card declined (code 51)",
		&inboxdb.ParkedMessage{UUID: "uuid-A-1042", Topic: "orders", Payload: []byte(`{"order_id":"A-1042","amount_cents":4999}`),
			PayloadSize: 41, Metadata: map[string]string{"order_id": "A-1042"}}))
	tx, err := db.Conn.BeginTx(ctx, nil)
	require.NoError(t, err)
	w, err := outbox.NewWriter(db)
	require.NoError(t, err)
	pub, err := w.Publisher(tx)
	require.NoError(t, err)
	for _, id := range []string{"inv-1", "inv-2"} {
		m := message.NewMessage(id, []byte(`{"invoice":"`+id+`"}`))
		m.SetContext(ctx)
		require.NoError(t, pub.Publish("invoices", m))
	}
	require.NoError(t, tx.Commit())

	const token = "s3cret-console-token-for-the-browser-test"
	mux, err := newMux(db, token)
	require.NoError(t, err)
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	base := srv.URL + prefix

	b := newBrowser(t, chromium)
	b.do(chromedp.Navigate(base + "/"))
	b.login(token)
	b.do(chromedp.WaitVisible(chromedp.CSS(`#relays-unavailable`)))
	require.Equal(t, "Not available on MySQL.", b.text(`#relays-unavailable`))
	require.Zero(t, b.count(`table#relays`))
	require.Zero(t, b.count(`#errors p.error`), "no error on the overview")
	require.Regexp(t, `^1\b`, b.text(`a.parked-link`))
	require.Contains(t, b.text(`dl#outbox`), "2")
	require.Equal(t, "mysql", b.text(`tr.consumer-row td`), "the SQL store is named after its engine")
	// The page's script redraws the table from the API every 5 seconds:
	// the store keeps its name.
	b.do(chromedp.Evaluate[chromedp.Void](`document.querySelector("tr.consumer-row").setAttribute("data-old", "1")`))
	b.do(chromedp.WaitReady(chromedp.CSS(`tr.consumer-row:not([data-old])`)))
	require.Equal(t, "mysql", b.text(`tr.consumer-row td`))
	b.screenshot("console-mariadb.png")

	b.do(chromedp.Navigate(base + "/parked/" + consumer + "/uuid-A-1042"))
	b.do(chromedp.WaitVisible(chromedp.CSS(`pre#payload`)))
	require.Contains(t, b.text(`pre#payload`), "A-1042")
}
