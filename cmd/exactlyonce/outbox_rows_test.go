package main

import (
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

type rowsJSON struct {
	Rows []rowJSON `json:"rows"`
	Next int64     `json:"next_after,omitempty"`
}

type actionJSON struct {
	Matching int64 `json:"matching"`
	Count    int64 `json:"count"`
	Done     bool  `json:"done"`
	// Confirm is the count's confirmation (--confirm takes it).
	Confirm string `json:"confirm"`
}

// counted is a's count, its confirmation checked and set apart.
func counted(t *testing.T, a actionJSON) actionJSON {
	t.Helper()
	require.Regexp(t, `^\d+@\d{4}-\d\d-\d\dT\S+Z(/\d+)?$`, a.Confirm, "the count prints its confirmation")
	a.Confirm = ""
	return a
}

// outbox rows, show, requeue and discard on real rows: two quarantined
// (one carrying a business id), one failing, one fresh.
func TestOutboxRowsCommands(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testOutboxRowsCommands)
}

func testOutboxRowsCommands(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	env := engineEnv(b)
	uuids := writeOutbox(t, db, "orders.charged", 4)
	ctx := testCtx(t)
	_, err := db.Conn.ExecContext(ctx, b.SQL(`UPDATE `+db.Outbox()+` SET failures = 6, attempts = 5, quarantined_at = now(),
 metadata = metadata || '{"order_id": "42"}', last_error = 'Exception (406) PRECONDITION_FAILED - message size larger than max' WHERE uuid = $1`,
		`UPDATE `+db.Outbox()+` SET failures = 6, attempts = 5, quarantined_at = UTC_TIMESTAMP(6),
 metadata = JSON_SET(metadata, '$.order_id', '42'), last_error = 'Exception (406) PRECONDITION_FAILED - message size larger than max' WHERE uuid = ?`), uuids[1])
	require.NoError(t, err)
	_, err = db.Conn.ExecContext(ctx, b.SQL(`UPDATE `+db.Outbox()+` SET failures = 1, attempts = 1, quarantined_at = now(),
 last_error = 'expiration refused' WHERE uuid = $1`, `UPDATE `+db.Outbox()+` SET failures = 1, attempts = 1, quarantined_at = UTC_TIMESTAMP(6),
 last_error = 'expiration refused' WHERE uuid = ?`), uuids[2])
	require.NoError(t, err)
	_, err = db.Conn.ExecContext(ctx, b.SQL(`UPDATE `+db.Outbox()+` SET failures = 2, next_attempt_at = now() + interval '1 hour',
 last_error = 'NO_ROUTE' WHERE uuid = $1`, `UPDATE `+db.Outbox()+` SET failures = 2, next_attempt_at = UTC_TIMESTAMP(6) + INTERVAL 1 HOUR,
 last_error = 'NO_ROUTE' WHERE uuid = ?`), uuids[3])
	require.NoError(t, err)

	// Find by the business id, by reason, and the failing ones.
	var rows rowsJSON
	decode(t, cli(t, env, "outbox", "rows", "--json", "--meta", "order_id=42"), &rows)
	require.Len(t, rows.Rows, 1)
	require.Equal(t, uuids[1], rows.Rows[0].UUID)
	require.Equal(t, "quarantined", rows.Rows[0].State)
	require.Equal(t, "42", rows.Rows[0].Metadata["order_id"])
	decode(t, cli(t, env, "outbox", "rows", "--json", "--reason", "EXPIRATION"), &rows)
	require.Len(t, rows.Rows, 1)
	require.Equal(t, uuids[2], rows.Rows[0].UUID)
	decode(t, cli(t, env, "outbox", "rows", "--json", "--state", "failing"), &rows)
	require.Len(t, rows.Rows, 1)
	require.Equal(t, uuids[3], rows.Rows[0].UUID)
	require.Equal(t, "failing", rows.Rows[0].State)
	// A row that never failed is ready (it once read "failing" in outbox
	// show), as the console and outbox pending call it.
	var fresh0 rowJSON
	decode(t, cli(t, env, "outbox", "show", "--json", itoa(rows.Rows[0].ID-3)), &fresh0)
	require.Equal(t, uuids[0], fresh0.UUID)
	require.Equal(t, "ready", fresh0.State)
	r0 := cli(t, env, "outbox", "show", itoa(fresh0.ID))
	requireOK(t, r0)
	require.Regexp(t, `\nstate +ready\n`, r0.stdout)
	decode(t, cli(t, env, "outbox", "rows", "--json", "--limit", "1"), &rows)
	require.Len(t, rows.Rows, 1)
	require.NotZero(t, rows.Next, "a next page")
	r := cli(t, env, "outbox", "rows")
	requireOK(t, r)
	require.Regexp(t, `orders.charged-001 +- +- +quarantined +6 \(5 permanent\) +Exception \(406\)`, r.stdout)

	// Show one: its payload and metadata.
	id := rows.Rows[0].ID
	r = cli(t, env, "outbox", "show", itoa(id))
	requireOK(t, r)
	require.Contains(t, r.stdout, "payload (9 bytes):\npayload 1")
	require.Contains(t, r.stdout, "order_id: 42")
	var one rowJSON
	decode(t, cli(t, env, "outbox", "show", "--json", itoa(id)), &one)
	require.Equal(t, uuids[1], one.UUID)
	require.Equal(t, "payload 1", *one.Payload.Text)

	// Bulk without --yes only counts; with --yes it acts.
	var act actionJSON
	decode(t, cli(t, env, "outbox", "requeue", "--json", "--reason", "expiration"), &act)
	token := act.Confirm
	require.Equal(t, actionJSON{Matching: 1}, counted(t, act))
	r = cli(t, env, "outbox", "requeue", "--reason", "expiration")
	requireOK(t, r)
	require.Regexp(t, `^1 row matches. Nothing done: the same command with --yes will requeue them.\n`+
		`To requeue exactly these \(refused, exit 4, if they changed\): --confirm 1@\S+/\d+\n$`, r.stdout)
	// A confirmation of another count is refused, nothing done, with the
	// count now; a malformed one is a usage error.
	requireExit(t, cli(t, env, "outbox", "requeue", "--reason", "expiration", "--confirm", "2"+token[1:]), exitChanged,
		"refused, nothing done: 1 of the 2 rows confirmed (expect) still match")
	requireExit(t, cli(t, env, "outbox", "requeue", "--reason", "expiration", "--confirm", "1@yesterday"), exitUsage, "--confirm")
	requireExit(t, cli(t, env, "outbox", "requeue", "--reason", "expiration", "--confirm", token, "--yes"), exitUsage, "not both")
	var done actionJSON
	decode(t, cli(t, env, "outbox", "requeue", "--json", "--reason", "expiration", "--yes"), &done)
	require.Equal(t, actionJSON{Count: 1, Done: true}, done)
	decode(t, cli(t, env, "outbox", "rows", "--json"), &rows)
	require.Len(t, rows.Rows, 1, "one quarantined row left")

	// Discard one by id; again: not found (exit 3); a fresh row: refused.
	r = cli(t, env, "outbox", "discard", itoa(id))
	requireOK(t, r)
	require.Equal(t, "Discarded 1 row.\n", r.stdout)
	requireExit(t, cli(t, env, "outbox", "discard", itoa(id)), exitNotFound, "outbox discard")
	var fresh rowsJSON
	decode(t, cli(t, env, "outbox", "rows", "--json", "--state", "all"), &fresh)
	requireExit(t, cli(t, env, "outbox", "requeue", itoa(1)), exitFailed, "not quarantined")

	// Usage errors.
	requireExit(t, cli(t, env, "outbox", "discard"), exitUsage, "give a row id, or criteria")
	requireExit(t, cli(t, env, "outbox", "discard", "1", "--reason", "x"), exitUsage, "not both")
	requireExit(t, cli(t, env, "outbox", "show", "x"), exitUsage, "not a row id")
	requireExit(t, cli(t, env, "outbox", "rows", "--meta", "novalue"), exitUsage, "key=value")
	requireExit(t, cli(t, env, "outbox", "rows", "--since", "yesterday"), exitUsage, "--since")
	requireExit(t, cli(t, env, "outbox", "rows", "--state", "x"), exitUsage, "--state")
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }
