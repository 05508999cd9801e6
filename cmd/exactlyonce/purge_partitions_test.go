package main

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"os/exec"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// `inbox purge --partitions` is inbox.Store.Purge: while partition
// maintenance is behind, a claim in flight into the partition it removes
// (a service's handler still running) is waited for and kept, and its
// redelivery is a duplicate. Without the purge's fence the command dropped
// the record with the partition.
func TestPurgePartitionsKeepsClaimInFlight(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	schema := freshSchema(t)
	env := dbEnv(schema)
	requireOK(t, cli(t, env, "migrate", "up", "--partitions", "daily"))

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pool := testenv.Pool(t)
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: schema,
		Partitions: &sqlschema.Partitioning{Interval: sqlschema.Daily}}.WithDefaults()
	l := inboxpart.Layout{Schema: schema, Table: db.InboxTable}
	run := func(q string) {
		t.Helper()
		_, err := pool.Exec(ctx, q)
		require.NoError(t, err, q)
	}
	// Maintenance stopped days ago: the newest partition ended yesterday.
	parts, err := l.List(ctx, db.Conn)
	require.NoError(t, err)
	for _, p := range parts {
		run("DROP TABLE " + l.Quoted(p.Name))
	}
	var now time.Time
	require.NoError(t, seam.QueryRow(ctx, db.Conn, "SELECT now()", nil, &now))
	old := l.Floor(now).AddDate(0, 0, -2)
	run("CREATE TABLE " + l.Quoted(l.Name(old)) + " (LIKE " + l.Parent() + " INCLUDING DEFAULTS INCLUDING CONSTRAINTS)")
	run("ALTER TABLE " + l.Parent() + " ATTACH PARTITION " + l.Quoted(l.Name(old)) + " FOR VALUES FROM (" +
		inboxpart.Literal(old) + ") TO (" + inboxpart.Literal(old.AddDate(0, 0, 1)) + ")")

	store, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	require.NoError(t, err)
	// The partitioned layout claims under READ COMMITTED only: ask for it,
	// whatever the database's default.
	tx, err := db.Conn.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	res, err := store.ClaimTx(ctx, tx, "c", "k")
	require.NoError(t, err)
	require.True(t, res.Claimed)
	var pid int
	require.NoError(t, seam.QueryRow(ctx, tx, "SELECT pg_backend_pid()", nil, &pid))

	type outcome struct {
		r   result
		err error
	}
	purged := make(chan outcome, 1)
	go func() {
		cmd := exec.CommandContext(ctx, binary, "inbox", "purge", "--partitions", "daily", "--older-than", "1h")
		cmd.Env = append(cleanEnv(), env...)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		o := outcome{r: result{stdout: stdout.String(), stderr: stderr.String()}}
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			o.r.code = exit.ExitCode()
		} else {
			o.err = err
		}
		purged <- o
	}()
	testenv.Eventually(t, 30*time.Second, func() bool {
		var n int
		err := seam.QueryRow(ctx, db.Conn, "SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))", []any{pid}, &n)
		return err == nil && n >= 1
	}, "the purge waits for the claim in flight")
	require.NoError(t, tx.Commit())
	o := <-purged
	require.NoError(t, o.err)
	requireOK(t, o.r)

	rec, err := store.Lookup(ctx, db.Conn, "c", "k")
	require.NoError(t, err, "the purge dropped a record that finished while it ran")
	require.Equal(t, inboxdb.StatusDone, rec.Status)
	parts, err = l.List(ctx, db.Conn)
	require.NoError(t, err)
	for _, p := range parts {
		require.NotEqual(t, l.Name(old), p.Name, "the partition past retention was dropped")
	}
}
