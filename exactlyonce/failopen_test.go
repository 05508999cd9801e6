package exactlyonce_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// TestFailOpenOnlyWhenUnreachable: FailOpen runs the handler without the
// inbox only when the database cannot be reached. A database that answers
// with an error (here a lock timeout while another worker's claim of the
// same key is uncommitted, and a missing inbox table) is a nack: running the
// handler then would run it a second time next to the other worker.
func TestFailOpenOnlyWhenUnreachable(t *testing.T) {
	t.Parallel()
	// A role whose sessions wait at most 200 ms for a lock, as a shop sets
	// it with ALTER ROLE ... SET lock_timeout.
	dbURL := testenv.DatabaseURLWithRoleSettings(t, map[string]string{"lock_timeout": "200ms"})
	admin := testenv.PoolFor(t, testenv.DirectDatabaseURL())
	for _, d := range testenv.DriversFor(t, dbURL) {
		t.Run(d.Name, func(t *testing.T) {
			t.Parallel()
			tables := testenv.WithConn(testenv.Schema(t), d.DB)
			for _, c := range []struct {
				name   string
				tables sqlschema.DB
				block  bool
			}{
				{name: "lock timeout (55P03)", tables: tables, block: true},
				{name: "missing table (42P01)", tables: sqlschema.DB{Conn: d.DB, Schema: tables.Schema, InboxTable: "no_such_inbox"}},
			} {
				t.Run(c.name, func(t *testing.T) {
					var ev testenv.Counters
					eo, err := exactlyonce.New(exactlyonce.Config{DB: c.tables, Consumer: "c", FailOpen: true,
						NackDelay: -1, OnEvent: ev.Observe, Logger: testenv.Logger(t)})
					require.NoError(t, err)
					if c.block {
						other, err := admin.Begin(context.Background())
						require.NoError(t, err)
						defer func() { _ = other.Rollback(context.Background()) }()
						_, err = other.Exec(context.Background(), `INSERT INTO `+tables.Inbox()+
							` (consumer, message_key, status, attempts, processed_at) VALUES ('c', 'k', 'done', 1, now())`)
						require.NoError(t, err)
					}
					var runs atomic.Int64
					_, err = eo.Middleware(func(*message.Message) ([]*message.Message, error) {
						runs.Add(1)
						return nil, nil
					})(message.NewMessage("k", nil))
					require.Zero(t, runs.Load(), "FailOpen must not run the handler when the database answered")
					require.Zero(t, ev.FailOpen.Load())
					require.ErrorIs(t, err, exactlyonce.ErrClaimFailed)
					require.NotErrorIs(t, err, exactlyonce.ErrDBUnavailable)
					require.Equal(t, int64(1), ev.ClaimFailed.Load())
					if !c.block {
						require.ErrorIs(t, err, sqlschema.ErrNotMigrated, "a missing table is a configuration error")
					}
				})
			}
		})
	}
}

// TestFailOpenRefusedInLeaseMode: lease mode exists to keep two workers off
// one key; running its handler without the claim would break that.
func TestFailOpenRefusedInLeaseMode(t *testing.T) {
	t.Parallel()
	d := testenv.Drivers(t)[0]
	_, err := exactlyonce.New(exactlyonce.Config{DB: sqlschema.DB{Conn: d.DB}, FailOpen: true,
		Lease: &exactlyonce.LeaseConfig{Duration: time.Minute}})
	require.Error(t, err)
	require.Contains(t, err.Error(), "FailOpen")
}
