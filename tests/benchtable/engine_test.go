package main

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestParseEngines(t *testing.T) {
	got, err := parseEngines("postgres, mariadb")
	require.NoError(t, err)
	require.Equal(t, []engine{postgres, mariadb}, got)
	got, err = parseEngines("mysql")
	require.NoError(t, err)
	require.Equal(t, []engine{mariadb}, got)
	for _, bad := range []string{"", "oracle", "postgres,postgres"} {
		_, err := parseEngines(bad)
		require.Error(t, err, bad)
	}
}

func TestEveryStatementOnBothEngines(t *testing.T) {
	for _, name := range []string{"CreateBusiness", "BusinessInsert", "Truncate", "Count", "Analyze", "FillOutbox", "Now", "FillInboxDay", "InboxSize"} {
		for _, e := range allEngines {
			q, err := sqlText(e, name, sqlData{Table: "t", Business: "b", Inbox: "i", Outbox: "o", From: 1, To: 2})
			require.NoError(t, err, "%s on %s", name, e)
			require.NotEmpty(t, q)
		}
	}
	_, err := sqlText(mariadb, "NoSuchStatement", sqlData{})
	require.Error(t, err)
}

func TestStmtShape(t *testing.T) {
	require.Equal(t, "INSERT INTO `bench_orders` (id, payload) VALUES (…)",
		stmtShape("INSERT INTO `benchtable_router_1a2b3c4d`.`bench_orders` (id, payload)\n  VALUES (?, ?)"))
	require.Equal(t, "SELECT a FROM t WHERE k = ? LIMIT N",
		stmtShape("-- A comment: what it's for.\nSELECT a FROM t WHERE k = 'it''s' LIMIT 500"))
	require.Equal(t, `BEGIN; EXECUTE c(…)`, stmtShape(`BEGIN; EXECUTE c('bench', 'key-1')`))
}

// The MariaDB fills must write what PostgreSQL's write: the retention
// inbox's keys are md5(g) as a UUID's text (uuidOfMD5, which the claims'
// redeliveries use, on both engines), at the same times; the outbox rows
// are the same messages.
func TestMariaDBFillsMatchPostgres(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	var pgKey string
	require.NoError(t, testenv.Pool(t).QueryRow(ctx, "SELECT md5(7::bigint::text)::uuid::text").Scan(&pgKey))
	require.Equal(t, pgKey, uuidOfMD5(7))

	my := testenv.MySQLDB(t)
	db := testenv.SchemaMySQL(t, wsql.BeginnerFromStdSQL(my))
	day := time.Date(2026, 11, 20, 0, 0, 0, 0, time.UTC)
	step := 3 * time.Second
	// Records 10..19 of a day whose first record is 10, in two chunks.
	for _, r := range [][2]int{{10, 14}, {15, 19}} {
		q := mustSQL(mariadb, "FillInboxDay", sqlData{Inbox: db.Inbox(), From: r[0], To: r[1]})
		_, err := my.ExecContext(ctx, q, day, 10, step.Microseconds())
		require.NoError(t, err)
	}
	for _, g := range []int{10, 13, 19} {
		var at time.Time
		var status string
		require.NoError(t, my.QueryRowContext(ctx, "SELECT processed_at, status FROM "+db.Inbox()+" WHERE consumer = 'bench' AND message_key = ?", uuidOfMD5(int64(g))).Scan(&at, &status))
		require.Equal(t, day.Add(time.Duration(g-10)*step), at.UTC(), "record %d", g)
		require.Equal(t, "done", status)
	}
	var n int64
	require.NoError(t, my.QueryRowContext(ctx, mustSQL(mariadb, "Count", sqlData{Table: db.Inbox()})).Scan(&n))
	require.EqualValues(t, 10, n)

	l := &relayLevel{engine: mariadb, db: db, backlog: 3}
	h := &harness{myAdmin: my}
	require.NoError(t, h.fillOutbox(ctx, l, "dest", 3))
	require.NoError(t, h.fillOutbox(ctx, l, "dest", 2))
	var uuid, topic, payload, metadata string
	require.NoError(t, my.QueryRowContext(ctx, "SELECT uuid, topic, payload, metadata FROM "+db.Outbox()+" ORDER BY id DESC LIMIT 1").Scan(&uuid, &topic, &payload, &metadata))
	require.Equal(t, []string{"ob-5", "dest", `{"n":5}`, `{"source":"bench"}`}, []string{uuid, topic, payload, metadata})
	pending, err := h.pendingOutbox(ctx, l)
	require.NoError(t, err)
	require.Equal(t, 5, pending)
}

// The -stmts connection on MariaDB counts what it sends and stays a MySQL
// handle for the library.
func TestTracedMySQLConnection(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	trace := newStmtTrace()
	my, err := openMySQL(ctx, testenv.MySQLURL(), 2, trace)
	require.NoError(t, err)
	t.Cleanup(func() { _ = my.Close() })
	db := sqlschema.DB{Conn: wsql.BeginnerFromStdSQL(my), Dialect: sqlschema.MySQL}
	require.NoError(t, db.ValidateConn())

	trace.take()
	tx, err := my.BeginTx(ctx, nil)
	require.NoError(t, err)
	var one int
	require.NoError(t, tx.QueryRowContext(ctx, "SELECT ? + 0", 1).Scan(&one))
	require.NoError(t, tx.Commit())
	got := trace.take()
	require.EqualValues(t, 1, got["BEGIN"].n)
	require.EqualValues(t, 1, got["COMMIT"].n)
	var stmts int64
	for k, v := range got {
		if k != "BEGIN" && k != "COMMIT" {
			stmts += v.n
		}
	}
	// Without interpolateParams a statement with arguments is a PREPARE
	// and an EXECUTE; with it one query.
	require.Positive(t, stmts)
}
