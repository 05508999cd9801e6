package main

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// The parked commands print one version (parked show: the message's), and
// docs/cli.md says --if-version takes it "as inbox show, parked show or
// outbox show prints it". An operator who looks at a parked message with
// parked show and releases its key with parked release --if-version and
// that version, nothing having changed, must not be told that the key
// changed (exit 4, nothing done): every such confirm would fail.
func TestParkedReleaseTakesTheVersionParkedShowPrints(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	db := testenv.Schema(t)
	env := dbEnv(db.Schema)
	inner, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, inner.Park(ctx, db.Conn, "ship-order", "k", "card declined",
		&inboxdb.ParkedMessage{UUID: "u1", Topic: "orders", Payload: []byte("p"), Metadata: map[string]string{}}))

	var shown parkedJSON
	decode(t, cli(t, env, "parked", "show", "--json", "ship-order", "k"), &shown)
	require.Equal(t, "parked", shown.Status)
	requireOK(t, cli(t, env, "parked", "release", "ship-order", "k", "--if-version", shown.Version))
}
