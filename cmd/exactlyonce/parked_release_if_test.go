package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// parked show prints the message's version; parked release acts on the
// key's record, whose version inbox show prints. An operator who gives
// release the message's version, nothing having changed, must not be told
// that the key changed (exit 4, nothing done): the version is refused as
// one of another kind, naming the command that shows the right one, and
// the record's version releases it.
func TestParkedReleaseTakesTheVersionParkedShowPrints(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testParkedReleaseTakesTheVersionParkedShowPrints)
}

func testParkedReleaseTakesTheVersionParkedShowPrints(t *testing.T, b *testenv.Bundle) {
	db := b.DB
	env := engineEnv(b)
	inner, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, inner.Park(ctx, db.Conn, "ship-order", "k", "card declined",
		&inboxdb.ParkedMessage{UUID: "u1", Topic: "orders", Payload: []byte("p"), Metadata: map[string]string{}}))

	var shown parkedJSON
	decode(t, cli(t, env, "parked", "show", "--json", "ship-order", "k"), &shown)
	require.Equal(t, "parked", shown.Status)
	requireExit(t, cli(t, env, "parked", "release", "ship-order", "k", "--if-version", shown.Version), exitUsage,
		"is not the version of a key's record: give the version inbox show")
	var rec recordJSON
	decode(t, cli(t, env, "inbox", "show", "--json", "-c", "ship-order", "k"), &rec)
	requireOK(t, cli(t, env, "parked", "release", "ship-order", "k", "--if-version", rec.Version))
}
