package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// outbox show and parked show print the payload's first 64 KiB and say
// so (a prefix that splits a character ends before it); --full-payload
// prints all of it; --json says payload_truncated. Lists give sizes only.
func TestShowPrintsABoundedPayload(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testShowPrintsABoundedPayload)
}

func testShowPrintsABoundedPayload(t *testing.T, b *testenv.Bundle) {
	db := b.DB.WithDefaults()
	env := engineEnv(b)
	ctx := testCtx(t)
	head := strings.Repeat("a", showPayloadBytes-1) + "€" // split by the bound
	payload := head + strings.Repeat("z", 1000)           // "zzz": no test name or hex suffix has it
	var id int64
	if b.MySQL() {
		b.Exec(t, `INSERT INTO `+db.Outbox()+` (topic, uuid, payload, metadata, created_at, failures, attempts, last_error, quarantined_at)
VALUES ('t', 'u-1', ?, '{}', UTC_TIMESTAMP(6), 5, 5, 'too large', UTC_TIMESTAMP(6))`, []byte(payload))
		require.NoError(t, seam.QueryRow(ctx, db.Conn, `SELECT id FROM `+db.Outbox()+` WHERE uuid = 'u-1'`, nil, &id))
	} else {
		require.NoError(t, seam.QueryRow(ctx, db.Conn, `INSERT INTO `+db.Outbox()+` (topic, uuid, payload, failures, attempts, last_error, quarantined_at)
VALUES ('t', 'u-1', $1, 5, 5, 'too large', now()) RETURNING id`, []any{[]byte(payload)}, &id))
	}
	inner, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	require.NoError(t, err)
	require.NoError(t, inner.Park(ctx, db.Conn, "c", "k", "too large",
		&inboxdb.ParkedMessage{UUID: "u-1", Topic: "t", Payload: []byte(payload), PayloadSize: len(payload)}))

	shown := payload[:showPayloadBytes-1]
	for _, show := range [][]string{{"outbox", "show", itoa(id)}, {"parked", "show", "c", "k"}} {
		r := cli(t, env, show...)
		requireOK(t, r)
		require.True(t, strings.Contains(r.stdout, "payload (66538 bytes), the first 65535 shown (the same command with --full-payload prints all of it):\n"+shown+"\n"),
			"%v: the first 65535 bytes: %.300s", show, r.stdout)
		require.False(t, strings.Contains(r.stdout, "€") || strings.Contains(r.stdout, "zzz"), "%v: not past the first 65535 bytes", show)

		r = cli(t, env, append(show, "--full-payload")...)
		requireOK(t, r)
		require.True(t, strings.Contains(r.stdout, "payload (66538 bytes):\n"+payload+"\n"), "%v --full-payload: all of it: %.300s", show, r.stdout)
	}

	var row rowJSON
	decode(t, cli(t, env, "outbox", "show", "--json", itoa(id)), &row)
	require.True(t, shown == *row.Payload.Text, "the first 65535 bytes")
	require.True(t, *row.PayloadTruncated)
	require.Equal(t, len(payload), row.PayloadBytes)
	decode(t, cli(t, env, "outbox", "show", "--json", "--full-payload", itoa(id)), &row)
	require.True(t, payload == *row.Payload.Text, "all of it")
	require.False(t, *row.PayloadTruncated)
	var m parkedJSON
	decode(t, cli(t, env, "parked", "show", "--json", "c", "k"), &m)
	require.True(t, shown == *m.Payload.Text, "the first 65535 bytes")
	require.True(t, *m.PayloadTruncated)
	require.Equal(t, len(payload), m.PayloadBytes)

	var rows rowsJSON
	decode(t, cli(t, env, "outbox", "rows", "--json"), &rows)
	require.Len(t, rows.Rows, 1)
	require.Equal(t, len(payload), rows.Rows[0].PayloadBytes)
	require.Nil(t, rows.Rows[0].Payload)
	var list parkedListJSON
	decode(t, cli(t, env, "parked", "list", "--json"), &list)
	require.Len(t, list.Messages, 1)
	require.Equal(t, len(payload), list.Messages[0].PayloadBytes)
	require.Nil(t, list.Messages[0].Payload)
}
