package leasestore_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
)

// store is a lease store as redisstore.Store is one: a Handle embedded.
type store struct{ leasestore.Handle }

// BackendOf gives the backend of a store made with one, and nil (never a
// panic) for no store, a nil store, and a store without a backend.
func TestBackendOf(t *testing.T) {
	t.Parallel()
	pg := &leasestore.Postgres{}
	require.Same(t, pg, leasestore.BackendOf(&store{leasestore.NewHandle(pg)}))
	require.Nil(t, leasestore.BackendOf(nil))
	var none *store
	require.Nil(t, leasestore.BackendOf(none))
	require.Nil(t, leasestore.BackendOf(&store{}))
	require.Nil(t, leasestore.BackendOf(store{}))
}
