package exactlyonce_test

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// partitionsBehind leaves the partitioned inbox of tables as maintenance
// that stopped days ago leaves it: the newest partition ended yesterday at
// midnight, none covers now. It returns the newest partition's name.
func partitionsBehind(t *testing.T, ctx context.Context, db wsql.Beginner, tables sqlschema.DB) string {
	t.Helper()
	l := inboxpart.Layout{Schema: tables.Schema, Table: tables.InboxTable}
	var now time.Time
	require.NoError(t, seam.QueryRow(ctx, db, "SELECT now()", nil, &now))
	from := l.Floor(now).AddDate(0, 0, -2)
	parts, err := l.List(ctx, db)
	require.NoError(t, err)
	var stmts []string
	for _, p := range parts {
		stmts = append(stmts, "DROP TABLE "+l.Quoted(p.Name)) // empty: nothing claimed yet
	}
	stmts = append(stmts,
		"CREATE TABLE "+l.Quoted(l.Name(from))+" (LIKE "+l.Parent()+" INCLUDING DEFAULTS INCLUDING CONSTRAINTS)",
		"ALTER TABLE "+l.Parent()+" ATTACH PARTITION "+l.Quoted(l.Name(from))+" FOR VALUES FROM ("+
			inboxpart.Literal(from)+") TO ("+inboxpart.Literal(from.AddDate(0, 0, 1))+")")
	for _, q := range stmts {
		_, err := db.ExecContext(ctx, q)
		require.NoError(t, err, q)
	}
	return l.Name(from)
}

// A purge while a handler runs, partition maintenance behind: the
// message's claim went into the newest partition, which ended yesterday,
// and while its handler runs (its transaction open) an operator's
// Purge(OlderThan: 1h) retires that partition. The message is processed
// once: its redelivery (to another instance) is a duplicate, its effect (a
// row in a business table, written in the handler's transaction) counted
// once. Unfenced, the purge dropped the record with the partition and the
// redelivery ran the handler again (seen: 2 effects). Right after, new
// messages through the middlewares that claimed before the purge
// (transactional and lease mode) are processed, not nacked; unfenced,
// their claims failed with "no partition of relation ... found for row"
// (SQLSTATE 23514) until the middleware's partition cache expired.
// Per-message and group commit, both drivers.
func TestPartitionedPurgeDuringHandler(t *testing.T) {
	t.Parallel()
	modes := map[string]func(*exactlyonce.Config){
		"transactional": func(*exactlyonce.Config) {},
		"batch": func(c *exactlyonce.Config) {
			c.Batch = &exactlyonce.BatchConfig{MaxSize: 4, MaxWait: time.Millisecond}
		},
	}
	for _, d := range testenv.Drivers(t) {
		for name, mode := range modes {
			t.Run(d.Name+"/"+name, func(t *testing.T) {
				t.Parallel()
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				tables := testenv.WithConn(testenv.SchemaLayout(t, "partitioned"), d.DB)
				old := partitionsBehind(t, ctx, d.DB, tables)
				effects := tables.Schema + ".effects"
				_, err := d.DB.ExecContext(ctx, "CREATE TABLE "+effects+" (key text NOT NULL)")
				require.NoError(t, err)
				countEffects := func(key string) int64 {
					return testenv.Count(t, d.DB, "SELECT count(*) FROM "+effects+" WHERE key = $1", key)
				}

				started := make(chan int, 1)
				release := make(chan struct{})
				handler := func(msg *message.Message) ([]*message.Message, error) {
					if err := testenv.Exec(msg.Context(), "INSERT INTO "+effects+" VALUES ($1)", msg.UUID); err != nil {
						return nil, err
					}
					if msg.UUID == "k" && countEffects("k") == 0 { // the first run
						var pid int
						if err := testenv.QueryRow(msg.Context(), "SELECT pg_backend_pid()", nil, &pid); err != nil {
							return nil, err
						}
						started <- pid
						<-release
					}
					return nil, nil
				}
				var ev testenv.Counters
				cfg := exactlyonce.Config{DB: tables, Consumer: "c", NackDelay: -1, OnEvent: ev.Observe, Logger: testenv.Logger(t)}
				mode(&cfg)
				eo, err := exactlyonce.New(cfg)
				require.NoError(t, err)
				h := eo.Middleware(handler)
				leaseCfg := exactlyonce.Config{DB: tables, Consumer: "lc", NackDelay: -1, Logger: testenv.Logger(t),
					Lease: &exactlyonce.LeaseConfig{}}
				le, err := exactlyonce.New(leaseCfg)
				require.NoError(t, err)
				lh := le.Middleware(handler)
				_, err = lh(message.NewMessage("lease-before", nil)) // its store now knows the partitions
				require.NoError(t, err)

				first := make(chan error, 1)
				go func() {
					_, err := h(message.NewMessage("k", nil))
					first <- err
				}()
				pid := <-started
				var where string
				require.NoError(t, seam.QueryRow(ctx, d.DB, "SELECT tableoid::regclass::text FROM "+tables.Inbox()+
					" WHERE consumer = 'lc' AND message_key = 'lease-before'", nil, &where))
				require.Contains(t, where, old, "claims go into the newest partition while maintenance is behind")

				store, err := inbox.NewStore(tables)
				require.NoError(t, err)
				purged := make(chan error, 1)
				go func() {
					_, err := store.Purge(ctx, inbox.PurgeOptions{OlderThan: time.Hour})
					purged <- err
				}()
				testenv.Eventually(t, 10*time.Second, func() bool {
					var n int
					err := seam.QueryRow(ctx, d.DB, "SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))", []any{pid}, &n)
					return err == nil && n >= 1
				}, "the purge waits for the handler's transaction")
				close(release)
				require.NoError(t, <-first)
				require.NoError(t, <-purged)

				// The redelivery, to another instance (started after the purge).
				other, err := exactlyonce.New(cfg)
				require.NoError(t, err)
				_, err = other.Middleware(handler)(message.NewMessage("k", nil))
				require.NoError(t, err)
				require.Equal(t, int64(1), countEffects("k"), "the redelivery ran the handler again: the purge dropped the record of k")
				require.Equal(t, int64(1), ev.Duplicates.Load())

				// The instance that ran k, and a lease-mode one, both with
				// their knowledge of the partitions from before the purge.

				_, err = h(message.NewMessage("after", nil))
				require.NoError(t, err, "a claim right after the purge")
				_, err = lh(message.NewMessage("lease-after", nil))
				require.NoError(t, err, "a lease claim right after the purge")
				for _, k := range []string{"after", "lease-after", "lease-before"} {
					require.Equal(t, int64(1), countEffects(k), k)
				}
			})
		}
	}
}
