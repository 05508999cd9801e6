package inboxdb_test

// Fuzz target of the pgx fast path's quoting (issue 5). Run it with
//   go test -run '^$' -fuzz FuzzBeginClaimPgx -fuzztime 25s ./internal/inboxdb/

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// fuzzClaimKeys are keys that would break naive quoting of the literal
// BeginClaimPgx sends (consumer and key are quoted into
// "BEGIN; INSERT INTO t (...) VALUES ('consumer', 'key', ...)").
var fuzzClaimKeys = []string{
	`'`, `''`, `\`, `\'`, `'\`, `'; DROP TABLE x; --`, `'); COMMIT; DROP TABLE x; --`,
	`', 'k'); --`, `', 'failed', 9, now()); --`, `E'\x41'`, `E'\''`, `$$`, `$$'$$`, `$tag$'$tag$`, `U&'\0041'`, `"`, `/*`, `--`,
	"ключ-🔑", "e\u0301", "\t\r\n", "\u202e", "\x7f", strings.Repeat("'", 2048), strings.Repeat(`\`, 2048),
}

// FuzzBeginClaimPgx claims arbitrary (consumer, key) pairs through the pgx
// fast path on a real connection, in a transaction that is rolled back:
// nothing panics; a pair ValidateKey refuses is refused with the same
// error, without touching the connection; a valid pair is claimed and the
// only row of the (otherwise empty) inbox table holds exactly the consumer
// and key given, byte for byte, so no quote, backslash or dollar sign was
// interpreted; and the connection is idle afterwards. Keys up to 2048 bytes
// (the largest MaxKeyLength); consumer names are cut at 200 bytes (see
// the report: consumer length is not bounded by ValidateKey).
func FuzzBeginClaimPgx(f *testing.F) {
	for _, k := range fuzzClaimKeys {
		f.Add("consumer", k)
		f.Add(k, "key")
	}
	f.Add("", "k")
	f.Add("c", "")
	f.Add("c", "a\x00b")
	f.Add("c\xff", "k")
	f.Add("c", strings.Repeat("k", 2049))

	ctx, cancel := context.WithCancel(context.Background())
	f.Cleanup(cancel)
	conn, tables := fuzzTempInbox(ctx, f)
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables, MaxKeyLength: 2048})
	require.NoError(f, err)
	check := `SELECT consumer, message_key, status, (SELECT count(*) FROM ` + store.Table() + `) FROM ` + store.Table()

	f.Fuzz(func(t *testing.T, consumer, key string) {
		if len(consumer) > 200 {
			consumer = consumer[:200]
		}
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		verr := store.ValidateKey(consumer, key)
		tx, res, err := store.BeginClaimPgx(ctx, conn, consumer, key)
		if verr != nil {
			require.Equal(t, byte('I'), conn.PgConn().TxStatus(), "a refused claim leaves the connection idle")
			require.Error(t, err)
			require.Equal(t, verr.Error(), err.Error())
			require.Nil(t, tx)
			require.False(t, res.Claimed)
			return
		}
		require.NoError(t, err, "consumer %q key %q", consumer, key)
		require.True(t, res.Claimed)
		require.NotNil(t, tx)
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()

		var gotConsumer, gotKey, status string
		var rows int64
		require.NoError(t, tx.QueryRow(ctx, check).Scan(&gotConsumer, &gotKey, &status, &rows))
		require.Equal(t, int64(1), rows, "exactly the claimed row")
		require.True(t, gotConsumer == consumer, "consumer stored as %q, want %q", gotConsumer, consumer)
		require.True(t, gotKey == key, "key stored as %q, want %q", gotKey, key)
		require.Equal(t, string(inboxdb.StatusDone), status)
		require.NoError(t, tx.Rollback(ctx))
		require.Equal(t, byte('I'), conn.PgConn().TxStatus())
	})
}

// fuzzTempInbox opens a connection of its own and creates the inbox table
// (the embedded migrations) in that session's temporary schema: go test
// -fuzz kills its worker processes when the time is up, before cleanups
// run, and a temporary schema goes away with the session instead of
// leaking. A temporary schema lives in one server session, so the
// connection goes to PostgreSQL itself (DIRECT_DATABASE_URL when the suite
// runs through PgBouncer, whose transaction pooling would run the next
// statement in another session).
func fuzzTempInbox(ctx context.Context, t testing.TB) (*pgx.Conn, sqlschema.DB) {
	t.Helper()
	conn, err := pgx.Connect(ctx, testenv.DirectDatabaseURL())
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(ctx, `CREATE TEMP TABLE fuzz_session (x int)`)
	require.NoError(t, err)
	var schema string
	require.NoError(t, conn.QueryRow(ctx, `SELECT nspname FROM pg_namespace WHERE oid = pg_my_temp_schema()`).Scan(&schema))
	tables := sqlschema.DB{Schema: schema}
	for _, m := range inboxMigrations(t, tables) {
		_, err := conn.Exec(ctx, m[1])
		require.NoError(t, err, m[0])
	}
	return conn, tables
}

// migrationHeader is the comment sqlschema.SQL puts before each migration.
var migrationHeader = regexp.MustCompile(`(?m)^-- (\S+\.up\.sql) \(target (inbox|outbox), version [0-9]+\)\n`)

// inboxMigrations returns the name and statements of every inbox migration
// in the script of sqlschema.SQL(db), in order: the inbox table alone,
// without the script's CREATE SCHEMA (a temporary schema cannot be named
// in one).
func inboxMigrations(t testing.TB, db sqlschema.DB) [][2]string {
	t.Helper()
	script, err := sqlschema.SQL(db)
	require.NoError(t, err)
	heads := migrationHeader.FindAllStringSubmatchIndex(script, -1)
	var out [][2]string
	for i, h := range heads {
		if script[h[4]:h[5]] != "inbox" {
			continue
		}
		end := len(script)
		if i+1 < len(heads) {
			end = heads[i+1][0]
		}
		out = append(out, [2]string{script[h[2]:h[3]], script[h[1]:end]})
	}
	require.NotEmpty(t, out, "no inbox migration in the script of sqlschema.SQL")
	return out
}

// The fast path quotes with PostgreSQL's standard_conforming_strings
// semantics and a UTF-8 connection. A session that turned either off (SET
// by a pool's AfterConnect, or by anyone sharing the connection) must make
// BeginClaimPgx refuse, never send a literal whose backslashes or bytes
// mean something else; the connection stays usable and nothing is written.
func TestBeginClaimPgxRefusesNonStandardSession(t *testing.T) {
	t.Parallel()
	tables := testenv.Schema(t)
	pool := testenv.Pool(t)
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	for _, set := range []struct{ set, reset string }{
		{"SET standard_conforming_strings = off", "RESET standard_conforming_strings"},
		{"SET client_encoding = 'LATIN1'", "RESET client_encoding"},
	} {
		pc, err := pool.Acquire(ctx)
		require.NoError(t, err)
		conn := pc.Conn()
		_, err = conn.Exec(ctx, set.set)
		require.NoError(t, err)
		key := `\'); DROP TABLE ` + store.Table() + `; --`
		tx, res, err := store.BeginClaimPgx(ctx, conn, "c", key)
		require.Error(t, err, set.set)
		require.Nil(t, tx)
		require.False(t, res.Claimed)
		require.Equal(t, byte('I'), conn.PgConn().TxStatus())
		_, err = conn.Exec(ctx, set.reset)
		require.NoError(t, err)
		tx, res, err = store.BeginClaimPgx(ctx, conn, "c", key)
		require.NoError(t, err, "after %s", set.reset)
		require.True(t, res.Claimed)
		var got string
		require.NoError(t, tx.QueryRow(ctx, `SELECT message_key FROM `+store.Table()).Scan(&got))
		require.Equal(t, key, got)
		require.NoError(t, tx.Rollback(ctx))
		pc.Release()
	}
	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+store.Table()).Scan(&n))
	require.Zero(t, n)
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_tables WHERE schemaname = $1`, tables.Schema).Scan(&n))
	require.Equal(t, 4, n, "inbox, parked messages, outbox and migrations tables still there")
}
