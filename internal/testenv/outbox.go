package testenv

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// OutboxStore returns db's outbox.Store, failing t if it cannot be built.
func OutboxStore(t testing.TB, db sqlschema.DB) *outbox.Store {
	t.Helper()
	s, err := outbox.NewStore(db)
	require.NoError(t, err)
	return s
}
