package chaos

// The harness's database, per dialect: PostgreSQL (a pgx pool, h.pool) or,
// for the @mariadb and @mariadb-rc runs, MariaDB (database/sql with
// go-sql-driver/mysql, h.my; the MySQL dialect). The harness's statements
// are given in both dialects (h.q); the rest of the harness is one.

import (
	"context"
	"database/sql"
	"encoding/json"
	"net/url"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/mysqldsn"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// q picks the statement of the run's dialect: pg for PostgreSQL, my for
// MariaDB.
func (h *harness) q(pg, my string) string {
	if h.v.mysql() {
		return my
	}
	return pg
}

// scanner is a row of either driver (pgx.Row, *sql.Row).
type scanner interface{ Scan(dest ...any) error }

// queryRow runs a one-row query on the run's database.
func (h *harness) queryRow(ctx context.Context, q string, args ...any) scanner {
	if h.v.mysql() {
		return h.my.QueryRowContext(ctx, q, args...)
	}
	return h.pool.QueryRow(ctx, q, args...)
}

// each runs q on the run's database and calls f with the Scan of each row.
func (h *harness) each(ctx context.Context, q string, args []any, f func(scan func(dest ...any) error) error) error {
	if h.v.mysql() {
		rows, err := h.my.QueryContext(ctx, q, args...)
		if err != nil {
			return err
		}
		defer func() { _ = rows.Close() }()
		for rows.Next() {
			if err := f(rows.Scan); err != nil {
				return err
			}
		}
		return rows.Err()
	}
	rows, err := h.pool.Query(ctx, q, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := f(rows.Scan); err != nil {
			return err
		}
	}
	return rows.Err()
}

// keysArg is the run's keys as one statement argument: a text[] for
// PostgreSQL (unnest($1::text[])), a JSON array for MariaDB (myKeys).
func (h *harness) keysArg() any {
	if !h.v.mysql() {
		return h.keys
	}
	b, err := json.Marshal(h.keys)
	require.NoError(h.t, err)
	return string(b)
}

// myKeys is the MariaDB table of the keys (keysArg), column k: a
// JSON_TABLE (MariaDB 10.6, MySQL 8), as PostgreSQL's unnest.
const myKeys = `JSON_TABLE(?, '$[*]' COLUMNS (k VARCHAR(64) PATH '$')) AS jt`

// setupMySQL creates the run's database on MariaDB (the library's tables,
// through sqlschema.Migrate with the MySQL dialect) and the effects tables,
// reached through h.my, a handle on the server's default database: the
// harness's own sessions are not in the run's database, the workers' are
// (killMySQL tells them apart so).
func (h *harness) setupMySQL(ctx context.Context) {
	t := h.t
	h.my = testenv.MySQLDB(t)
	h.tables = testenv.SchemaMySQL(t, wsql.BeginnerFromStdSQL(h.my))
	// Keys and UUIDs are VARBINARY (compared byte-wise, as the library's
	// keys); txid is the worker's name for the transaction that wrote the
	// effect (MariaDB has no reliable transaction id to read in a DEFAULT
	// or a trigger: INFORMATION_SCHEMA.INNODB_TRX is a cache refreshed at
	// most every 0.1 s).
	for _, st := range []string{
		`CREATE TABLE ` + h.table("effects") + ` (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
` + "`key`" + ` VARBINARY(64) NOT NULL, attempt INT NOT NULL, worker VARCHAR(64) NOT NULL, out_uuid VARBINARY(64) NOT NULL,
at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)), txid VARCHAR(64) NOT NULL, KEY (` + "`key`" + `), KEY (out_uuid)) ENGINE = InnoDB`,
		`CREATE TABLE ` + h.table("down_effects") + ` (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY,
` + "`key`" + ` VARBINARY(64) NOT NULL, uuid VARBINARY(64) NOT NULL, worker VARCHAR(64) NOT NULL,
at DATETIME(6) NOT NULL DEFAULT (UTC_TIMESTAMP(6)), KEY (` + "`key`" + `), KEY (uuid)) ENGINE = InnoDB`,
	} {
		_, err := h.my.ExecContext(ctx, st)
		require.NoError(t, err)
	}
}

// mysqlWorkerURL is the mysql:// URL the workers dial: the proxy, the run's
// database, and for @mariadb-rc sessions defaulting to READ COMMITTED
// (tx_isolation, a system variable go-sql-driver SETs on connect). It
// checks the workers' default isolation through it.
func (h *harness) mysqlWorkerURL(ctx context.Context) string {
	t := h.t
	u, err := url.Parse(testenv.MySQLURL())
	require.NoError(t, err)
	u.Path = "/" + h.tables.Schema
	want := "REPEATABLE-READ"
	if h.v.DB == dbMariaDBRC {
		want = "READ-COMMITTED"
		q := u.Query()
		q.Set("tx_isolation", "'"+want+"'")
		u.RawQuery = q.Encode()
	}
	workerURL := h.dbProxy.RewriteURL(u.String())
	dsn, err := mysqldsn.FromURL(workerURL)
	require.NoError(t, err)
	db, err := sql.Open("mysql", dsn)
	require.NoError(t, err)
	defer func() { _ = db.Close() }()
	var iso string
	require.NoError(t, db.QueryRowContext(ctx, `SELECT @@tx_isolation`).Scan(&iso))
	require.Equal(t, want, iso, "the workers' sessions default to %s", want)
	return workerURL
}

// logSessionsMySQL is logSessions on MariaDB: the sessions in the run's
// database with their transactions, and the outbox's state.
func (h *harness) logSessionsMySQL(ctx context.Context) {
	t := h.t
	err := h.each(ctx, `SELECT p.id, p.command, p.time, coalesce(p.state, ''), coalesce(left(p.info, 120), ''),
coalesce(x.trx_state, ''), coalesce(x.trx_rows_locked, 0)
FROM information_schema.processlist p LEFT JOIN information_schema.innodb_trx x ON x.trx_mysql_thread_id = p.id
WHERE p.db = ? AND p.id <> CONNECTION_ID()`, []any{h.tables.Schema}, func(scan func(...any) error) error {
		var id, secs, locked int64
		var command, state, info, trx string
		if err := scan(&id, &command, &secs, &state, &info, &trx, &locked); err != nil {
			return err
		}
		t.Logf("session %d %s for %ds state %q, transaction %q (%d rows locked); query %q", id, command, secs, state, trx, locked, info)
		return nil
	})
	if err != nil {
		t.Logf("sessions: %v", err)
	}
	var due, deferred, quarantined int64
	if err := h.my.QueryRowContext(ctx, `SELECT coalesce(sum(quarantined_at IS NULL AND (next_attempt_at IS NULL OR next_attempt_at <= UTC_TIMESTAMP(6))), 0),
coalesce(sum(next_attempt_at > UTC_TIMESTAMP(6)), 0), coalesce(sum(quarantined_at IS NOT NULL), 0) FROM `+h.tables.Outbox()).
		Scan(&due, &deferred, &quarantined); err == nil {
		t.Logf("outbox rows due %d, deferred %d, quarantined %d", due, deferred, quarantined)
	}
	_ = h.each(ctx, `SELECT id, topic, JSON_CONTAINS_PATH(metadata, 'one', CONCAT('$.', ?)), failures, attempts,
coalesce(TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), next_attempt_at) / 1e6, ''), coalesce(left(last_error, 80), '')
FROM `+h.tables.Outbox()+` WHERE quarantined_at IS NULL ORDER BY id LIMIT 10`, []any{poisonMetadata}, func(scan func(...any) error) error {
		var id, failures, attempts int64
		var poison bool
		var topic, next, lastErr string
		if err := scan(&id, &topic, &poison, &failures, &attempts, &next, &lastErr); err != nil {
			return err
		}
		t.Logf("row %d topic %s poison %v: failures %d, permanent %d, next in %ss: %s", id, topic, poison, failures, attempts, next, lastErr)
		return nil
	})
}
