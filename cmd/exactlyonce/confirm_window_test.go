package main

import (
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// A bulk action run with the confirmation of its count acts on what the
// count selected, also when the count's criteria name a time relative to
// now (--until 1h): the action resolves it as the count did, not an hour
// before the moment the action runs, a window that slid since the count.
// Otherwise a row outside the count's window when it counted comes inside
// it by the time of the action; the count confirmed stays the same when
// another row the count saw went meanwhile, and the action discards a row
// the operator never saw counted. (The console refuses a relative time in
// a bulk action for the same reason.)
func TestOutboxDiscardConfirmKeepsTheCountsWindow(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testOutboxDiscardConfirmKeepsTheCountsWindow)
}

func testOutboxDiscardConfirmKeepsTheCountsWindow(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	env := engineEnv(b)
	uuids := writeOutbox(t, db, "orders.charged", 2)
	ctx := testCtx(t)
	// The older row (smaller id) was retried for an hour and quarantined
	// just inside the last hour; the newer one two hours ago.
	const margin = 3 * time.Second
	if b.MySQL() {
		b.Exec(t, `UPDATE `+db.Outbox()+` SET failures = 5, attempts = 5, last_error = 'refused',
 quarantined_at = UTC_TIMESTAMP(6) - INTERVAL 1 HOUR + INTERVAL ? SECOND WHERE uuid = ?`, int(margin.Seconds()), uuids[0])
	} else {
		b.Exec(t, `UPDATE `+db.Outbox()+` SET failures = 5, attempts = 5, last_error = 'refused',
 quarantined_at = now() - interval '1 hour' + $2 * interval '1 second' WHERE uuid = $1`, uuids[0], margin.Seconds())
	}
	_, err := db.Conn.ExecContext(ctx, b.SQL(`UPDATE `+db.Outbox()+` SET failures = 5, attempts = 5, last_error = 'refused',
 quarantined_at = now() - interval '2 hours' WHERE uuid = $1`, `UPDATE `+db.Outbox()+` SET failures = 5, attempts = 5, last_error = 'refused',
 quarantined_at = UTC_TIMESTAMP(6) - INTERVAL 2 HOUR WHERE uuid = ?`), uuids[1])
	require.NoError(t, err)
	var rows rowsJSON
	decode(t, cli(t, env, "outbox", "rows", "--json"), &rows)
	require.Len(t, rows.Rows, 2)
	inside, counted := rows.Rows[0], rows.Rows[1]
	require.Equal(t, uuids[0], inside.UUID)

	// The count quarantined before an hour ago: the older quarantine only.
	var count actionJSON
	decode(t, cli(t, env, "outbox", "discard", "--json", "--until", "1h"), &count)
	require.Equal(t, int64(1), count.Matching, "the count sees the row quarantined two hours ago")
	// Someone discards that row; the other one's quarantine passes the
	// hour mark.
	requireOK(t, cli(t, env, "outbox", "discard", itoa(counted.ID)))
	time.Sleep(margin + time.Second)

	// What the count saw is gone: refused, nothing done.
	r := cli(t, env, "outbox", "discard", "--until", "1h", "--confirm", count.Confirm)
	requireExit(t, r, exitChanged, "refused, nothing done")
	var still rowJSON
	decode(t, cli(t, env, "outbox", "show", "--json", itoa(inside.ID)), &still)
	require.Equal(t, inside.UUID, still.UUID, "the row the count did not select is kept")
	// The refusal's count now is of the same command now: the other row,
	// and its confirmation acts on it.
	require.Contains(t, r.stderr, "1 row matches now")
	m := regexp.MustCompile(`--confirm (\S+)`).FindStringSubmatch(r.stderr)
	require.NotNil(t, m, "%s", r)
	r = cli(t, env, "outbox", "discard", "--until", "1h", "--confirm", m[1])
	requireOK(t, r)
	require.Equal(t, "Discarded 1 row.\n", r.stdout)
}

// The same for parked messages: the count's --until 1h is resolved as the
// count did when the action runs with its confirmation.
func TestParkedDiscardConfirmKeepsTheCountsWindow(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testParkedDiscardConfirmKeepsTheCountsWindow)
}

func testParkedDiscardConfirmKeepsTheCountsWindow(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	env := engineEnv(b)
	const margin = 3 * time.Second
	d := db.WithDefaults()
	parked := d.Dialect.QuoteIdentifier(d.Schema, d.InboxTable+"_parked")
	for _, m := range []struct {
		key   string
		hours int
	}{{"inside", 1}, {"counted", 2}} {
		secs := map[bool]int{true: int(margin.Seconds()), false: 0}[m.key == "inside"]
		if b.MySQL() {
			b.Exec(t, `INSERT INTO `+db.Inbox()+` (consumer, message_key, status, attempts, first_seen_at, processed_at, last_error, parked_by_transaction)
VALUES ('ship-order', ?, 'parked', 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6), 'refused', true)`, m.key)
			b.Exec(t, `INSERT INTO `+parked+` (consumer, message_key, message_uuid, topic, payload, payload_size, metadata, reason, attempts, first_seen_at, parked_at)
VALUES ('ship-order', ?, ?, 'orders', 'x', 1, '{}', 'refused', 1, UTC_TIMESTAMP(6), UTC_TIMESTAMP(6) - INTERVAL ? HOUR + INTERVAL ? SECOND)`,
				m.key, m.key, m.hours, secs)
			continue
		}
		b.Exec(t, `INSERT INTO `+db.Inbox()+` (consumer, message_key, status, attempts, processed_at, last_error, parked_by_transaction)
VALUES ('ship-order', $1, 'parked', 1, now(), 'refused', true)`, m.key)
		b.Exec(t, `INSERT INTO `+parked+` (consumer, message_key, message_uuid, topic, payload, payload_size, metadata, reason, attempts, first_seen_at, parked_at)
VALUES ('ship-order', $1, $1, 'orders', 'x', 1, '{}', 'refused', 1, now(), now() - $2 * interval '1 hour' + $3 * interval '1 second')`,
			m.key, m.hours, secs)
	}
	var count actionJSON
	decode(t, cli(t, env, "parked", "discard", "--json", "-c", "ship-order", "--until", "1h"), &count)
	require.Equal(t, int64(1), count.Matching, "the count sees the message parked two hours ago")
	requireOK(t, cli(t, env, "parked", "discard", "ship-order", "counted"))
	time.Sleep(margin + time.Second)

	requireExit(t, cli(t, env, "parked", "discard", "-c", "ship-order", "--until", "1h", "--confirm", count.Confirm), exitChanged, "refused, nothing done")
	requireOK(t, cli(t, env, "parked", "show", "ship-order", "inside"))
}
