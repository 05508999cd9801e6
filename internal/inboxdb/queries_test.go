package inboxdb_test

import (
	"context"
	"strings"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// TestQueriesPrepare renders every statement of queries/postgres (and
// inboxpart's) for the plain, daily and hourly layouts, and has
// PostgreSQL parse and plan each one (PREPARE, then DEALLOCATE) in a schema
// migrated for it: a typo in a .sql file fails here, not for a user. The
// run-time templates are filled with sample values; those that are DDL
// (PostgreSQL prepares no DDL) are run on a sample partition instead.
func TestQueriesPrepare(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		layout string
		parts  *sqlschema.Partitioning
	}{
		{"plain", nil},
		{"daily", &sqlschema.Partitioning{Interval: sqlschema.Daily, Ahead: 1}},
		{"hourly", &sqlschema.Partitioning{Interval: sqlschema.Hourly, Ahead: 1}},
	} {
		t.Run(c.layout, func(t *testing.T) {
			t.Parallel()
			tables := testenv.SchemaWith(t, sqlschema.DB{Partitions: c.parts}).WithDefaults()
			store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
			require.NoError(t, err)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			conn, err := testenv.Pool(t).Acquire(ctx)
			require.NoError(t, err)
			defer conn.Release()

			var layout inboxpart.Layout
			from := time.Date(2099, 1, 1, 0, 0, 0, 0, time.UTC)
			sample := map[string]string{"Consumer": "c", "Key": "k", "Name": "eo_test_prepare", "Where": "p.reason <> ''"}
			if c.parts != nil {
				layout = inboxpart.Layout{Schema: tables.Schema, Table: tables.InboxTable, Hourly: c.parts.Interval == sqlschema.Hourly}
				sample["Partition"] = layout.Quoted(layout.Name(from))
				sample["From"] = inboxpart.Literal(from)
				sample["To"] = inboxpart.Literal(from.Add(layout.Step()))
			}
			fill := func(t *testing.T, name, text string) string {
				parts := strings.Split(text, "\x00")
				require.Equal(t, 1, len(parts)%2, "%s: an unclosed hole", name)
				for i := 1; i < len(parts); i += 2 {
					v, ok := sample[parts[i]]
					require.True(t, ok, "%s: a hole %q without a sample value", name, parts[i])
					parts[i] = v
				}
				return strings.Join(parts, "")
			}
			// inTx runs a statement and the DEALLOCATE of what it prepared
			// in one transaction: through a pooler in transaction pooling
			// (the core suite runs through PgBouncer) two statements outside
			// one may go to two server connections, leaving one prepared.
			inTx := func(t *testing.T, name, text, deallocate string) {
				t.Helper()
				tx, err := conn.Begin(ctx)
				require.NoError(t, err)
				defer func() { _ = tx.Rollback(ctx) }()
				_, err = tx.Exec(ctx, text)
				require.NoError(t, err, "%s:\n%s", name, text)
				_, err = tx.Exec(ctx, "DEALLOCATE "+deallocate)
				require.NoError(t, err)
			}
			prepare := func(t *testing.T, name, text string) {
				t.Helper()
				inTx(t, name, "PREPARE eo_check AS "+text, "eo_check")
			}
			exec := func(t *testing.T, name, text string) {
				t.Helper()
				_, err := conn.Exec(ctx, text)
				require.NoError(t, err, "%s:\n%s", name, text)
			}

			// The DDL templates, run in order on a sample partition.
			ddl := map[string]bool{}
			if c.parts != nil {
				st, err := layout.Statements()
				require.NoError(t, err)
				for _, name := range st.Names() {
					text := fill(t, name, st.Get(name))
					if name != "CreatePartition" && name != "AttachPartition" {
						prepare(t, name, text)
					}
				}
				exec(t, "CreatePartition", fill(t, "CreatePartition", st.Get("CreatePartition")))
				exec(t, "AttachPartition", fill(t, "AttachPartition", st.Get("AttachPartition")))
				q := func(name string) string { ddl[name] = true; return fill(t, name, store.Statement(name)) }
				// PostgreSQL refuses to finalize a detach that is not
				// pending, after parsing the statement.
				_, err = conn.Exec(ctx, q("DetachFinalize"))
				require.Error(t, err)
				require.NotEqual(t, "42601", pgerr.Code(err), "DetachFinalize: %v", err)
				exec(t, "DetachConcurrently", q("DetachConcurrently"))
				prepare(t, "CountDetachedAfter", q("CountDetachedAfter"))
				prepare(t, "CountDetachedOpen", q("CountDetachedOpen"))
				exec(t, "AttachAgain", q("AttachAgain"))
				exec(t, "DetachConcurrently", q("DetachConcurrently"))
				exec(t, "DropDetached", q("DropDetached"))
			}

			names := store.StatementNames()
			require.NotEmpty(t, names)
			for _, name := range names {
				if ddl[name] {
					continue
				}
				text := fill(t, name, store.Statement(name))
				switch {
				case name == "Rollback":
					require.Equal(t, "ROLLBACK", text)
				case strings.HasPrefix(text, "PREPARE "):
					inTx(t, name, text, sample["Name"])
				case strings.HasPrefix(text, "BEGIN; EXECUTE "):
					continue // the EXECUTE of ClaimPrepare: run by the claim tests
				case strings.HasPrefix(text, "BEGIN; "):
					prepare(t, name, strings.TrimPrefix(text, "BEGIN; "))
				case strings.HasPrefix(text, "ROLLBACK; "):
					prepare(t, name, strings.TrimPrefix(text, "ROLLBACK; "))
				default:
					prepare(t, name, text)
				}
			}
			checkAllLayoutsChecked(t, c.layout, names)
		})
	}
}

// checkAllLayoutsChecked asserts that a layout's set of statements has the
// ones every claim path needs: a missing file or a misnamed statement
// would otherwise shrink the set the test checks.
func checkAllLayoutsChecked(t *testing.T, layout string, names []string) {
	want := []string{"ClaimInsert", "CountDuplicate", "LeaseLockRecord", "Lookup", "FindParked", "Park", "ParkKeep", "PurgeRows"}
	if layout == "plain" {
		want = append(want, "BeginClaimLiteral", "ClaimPrepare", "BeginClaimExecute", "LeaseInsert")
	} else {
		want = append(want, "ClaimInsertFallback", "ClaimLock", "ClaimLockFallback", "BeginClaimLock", "BeginClaimFunc",
			"LeaseInsertFallback", "MoveKept", "DetachConcurrently", "KeyLock", "KeysLock", "FenceFallbackWrites")
	}
	for _, n := range want {
		require.Contains(t, names, n, layout)
	}
}

// TestQueriesPrepareMySQL has MariaDB parse every statement of
// queries/mysql (PREPARE ... FROM, then DEALLOCATE) in a database migrated
// for it, on one connection (prepared statements are the session's): a
// typo in a .sql file fails here, not for a user. The run-time templates'
// holes are filled with sample text (a filter condition, one row, one key,
// one key). ClaimBatchRow is a row of ClaimBatchInsert, checked inside it.
func TestQueriesPrepareMySQL(t *testing.T) {
	t.Parallel()
	db := testenv.MySQLDB(t)
	tables := testenv.SchemaMySQL(t, wsql.BeginnerFromStdSQL(db))
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := db.Conn(ctx)
	require.NoError(t, err)
	defer func() { _ = conn.Close() }()

	sample := map[string]string{"Where": "p.reason <> ''", "Rows": store.Statement("ClaimBatchRow"), "Keys": "?",
		"Reads": store.Statement("ClaimBatchLockOne") + " UNION ALL " + store.Statement("ClaimBatchLockOne")}
	names := store.StatementNames()
	for _, name := range names {
		if name == "ClaimBatchRow" || name == "ClaimBatchLockOne" {
			continue // parts of ClaimBatchInsert's and ClaimBatchLock's texts
		}
		parts := strings.Split(store.Statement(name), "\x00")
		require.Equal(t, 1, len(parts)%2, "%s: an unclosed hole", name)
		for i := 1; i < len(parts); i += 2 {
			v, ok := sample[parts[i]]
			require.True(t, ok, "%s: a hole %q without a sample value", name, parts[i])
			parts[i] = v
		}
		text := strings.Join(parts, "")
		// PREPARE itself is not preparable: the text travels in a variable.
		_, err := conn.ExecContext(ctx, "SET @eo_check = ?", text)
		require.NoError(t, err)
		_, err = conn.ExecContext(ctx, "PREPARE eo_check FROM @eo_check")
		require.NoError(t, err, "%s:\n%s", name, text)
		_, err = conn.ExecContext(ctx, "DEALLOCATE PREPARE eo_check")
		require.NoError(t, err)
	}
	for _, n := range []string{"ClaimInsert", "LockRecord", "Reclaim", "ClaimBatchInsert", "ClaimBatchLock", "ClaimBatchFix",
		"Lookup", "ForgetRecord", "Release", "Park", "KeepParked", "FindParked", "DiscardParkedBatch", "PurgePick"} {
		require.Contains(t, names, n)
	}
}
