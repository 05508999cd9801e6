package exactlyonce_test

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// Every mode on the time-partitioned inbox layout (sqlschema.DB.Partitions),
// both drivers: per-message transactional (the pgx pool's one-round-trip
// path, database/sql's two statements), group commit and lease mode. A key
// recorded in yesterday's partition is a duplicate today; a new key runs
// once however often it is delivered (copies at the same moment included);
// a Permanent error parks the key. Under a REPEATABLE READ default the
// transactional modes nack (ErrClaimFailed, the handler never runs): their
// claim would not see a copy committed while it waited for the key's lock.
// Lease mode's claim is READ COMMITTED of its own and runs.
func TestPartitionedLayoutModes(t *testing.T) {
	t.Parallel()
	modes := map[string]func(*exactlyonce.Config){
		"transactional": func(*exactlyonce.Config) {},
		"batch": func(c *exactlyonce.Config) {
			c.Batch = &exactlyonce.BatchConfig{MaxSize: 4, MaxWait: 50 * time.Millisecond}
		},
		"lease": func(c *exactlyonce.Config) { c.Lease = &exactlyonce.LeaseConfig{} },
	}
	rrURL := testenv.DatabaseURLWithIsolation(t, testenv.RepeatableRead)
	rrDrivers := testenv.DriversFor(t, rrURL)
	for i, d := range testenv.Drivers(t) {
		for name, mode := range modes {
			t.Run(d.Name+"/"+name, func(t *testing.T) {
				t.Parallel()
				tables := testenv.WithConn(testenv.SchemaLayout(t, "partitioned"), d.DB)
				ctx := t.Context()
				l := inboxpart.Layout{Schema: tables.Schema, Table: tables.InboxTable}
				var now time.Time
				require.NoError(t, seam.QueryRow(ctx, d.DB, "SELECT now()", nil, &now))
				yesterday := l.Floor(now).AddDate(0, 0, -1)
				for _, q := range []string{
					"CREATE TABLE " + l.Quoted(l.Name(yesterday)) + " (LIKE " + l.Parent() + " INCLUDING DEFAULTS INCLUDING CONSTRAINTS)",
					"ALTER TABLE " + l.Parent() + " ATTACH PARTITION " + l.Quoted(l.Name(yesterday)) + " FOR VALUES FROM (" +
						inboxpart.Literal(yesterday) + ") TO (" + inboxpart.Literal(yesterday.AddDate(0, 0, 1)) + ")",
				} {
					_, err := d.DB.ExecContext(ctx, q)
					require.NoError(t, err)
				}
				_, err := d.DB.ExecContext(ctx, "INSERT INTO "+tables.Inbox()+` (consumer, message_key, status, processed_at, partition_at)
VALUES ('c', 'old', 'done', $1::timestamptz, $1::timestamptz)`, yesterday.Add(time.Hour))
				require.NoError(t, err)

				var mu sync.Mutex
				runs := map[string]int{}
				handler := func(msg *message.Message) ([]*message.Message, error) {
					mu.Lock()
					runs[msg.UUID]++
					mu.Unlock()
					if msg.UUID == "perm" {
						return nil, exactlyonce.Permanent(errors.New("cannot ever work"))
					}
					return nil, nil
				}
				var ev testenv.Counters
				cfg := exactlyonce.Config{DB: tables, Consumer: "c", NackDelay: -1, OnEvent: ev.Observe, Logger: testenv.Logger(t)}
				mode(&cfg)
				eo, err := exactlyonce.New(cfg)
				require.NoError(t, err)
				h := eo.Middleware(handler)

				for i, r := range deliver(t, h, msgs("old", "new", "new", "new")...) {
					if name == "lease" && errors.Is(r.err, exactlyonce.ErrLeaseHeld) {
						// A copy that met the first one's lease: nacked,
						// and its redelivery is a duplicate.
						_, r.err = h(msgs("old", "new", "new", "new")[i])
					}
					require.NoError(t, r.err)
				}
				for range 2 {
					_, err := h(message.NewMessage("perm", nil))
					require.NoError(t, err)
				}
				require.Equal(t, map[string]int{"new": 1, "perm": 1}, runs)
				require.Equal(t, int64(1), ev.Processed.Load())
				require.Equal(t, int64(3), ev.Duplicates.Load(), "old, and two copies of new")
				require.Equal(t, int64(2), ev.Parked.Load())

				rrCfg := cfg
				rrCfg.DB = testenv.WithConn(tables, rrDrivers[i].DB)
				rrCfg.OnEvent = nil
				rr, err := exactlyonce.New(rrCfg)
				require.NoError(t, err)
				_, err = rr.Middleware(handler)(message.NewMessage("rr", nil))
				if name == "lease" {
					require.NoError(t, err)
					require.Equal(t, 1, runs["rr"])
				} else {
					require.ErrorIs(t, err, exactlyonce.ErrClaimFailed)
					require.ErrorContains(t, err, "READ COMMITTED")
					require.Zero(t, runs["rr"])
				}
			})
		}
	}
}
