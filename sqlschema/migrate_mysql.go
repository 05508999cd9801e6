package sqlschema

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlfile"
)

// ErrEngine is wrapped by the errors of a MySQL server or connection that
// the library cannot work with: a server without SKIP LOCKED (MySQL before
// 8.0.1, MariaDB before 10.6), a DSN without parseTime=true, a table that
// is not InnoDB. docs/mysql.md says what is required.
var ErrEngine = errors.New("the MySQL server or connection does not meet the library's requirements")

// stdDB returns the *sql.DB behind a wsql.BeginnerFromStdSQL(db), which
// MySQL's Migrate needs: its DDL commits implicitly, so it runs on one
// connection of its own rather than in a transaction.
func stdDB(b wsql.Beginner) (*stdsql.DB, bool) {
	switch v := b.(type) {
	case wsql.StdSQLBeginner:
		db, ok := v.SQLBeginner.(*stdsql.DB)
		return db, ok
	case *wsql.StdSQLBeginner:
		if v == nil {
			return nil, false
		}
		db, ok := v.SQLBeginner.(*stdsql.DB)
		return db, ok
	}
	return nil, false
}

// migrateMySQL is Migrate on MySQL. DDL commits implicitly, so there is no
// transaction to make the migrations atomic: it runs on one connection,
// serialised against other Migrate calls by a session-level named lock, and
// records each migration as soon as its statements ran. Every statement is
// idempotent (IF NOT EXISTS), so a Migrate cut off half-way is finished by
// the next one.
func migrateMySQL(ctx context.Context, cfg DB, st sqlfile.Statements, migs []migration) (err error) {
	db, ok := stdDB(cfg.Conn)
	if !ok {
		return errors.New("sqlschema: Migrate: on MySQL DB.Conn must be wsql.BeginnerFromStdSQL(db) of a *sql.DB")
	}
	conn, err := db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("sqlschema: Migrate: connecting: %w", err)
	}
	defer func() { _ = conn.Close() }()
	if err := checkConn(ctx, conn, st); err != nil {
		return fmt.Errorf("sqlschema: Migrate: %w", err)
	}
	var got stdsql.NullInt64
	if err := conn.QueryRowContext(ctx, st.Get("MigrateLock")).Scan(&got); err != nil {
		return fmt.Errorf("sqlschema: Migrate: taking the migration lock: %w", err)
	}
	if got.Int64 != 1 {
		return fmt.Errorf("sqlschema: Migrate: another Migrate held the lock %q for 60 s", mysqlLockName)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_, _ = conn.ExecContext(ctx, st.Get("MigrateUnlock"))
	}()
	if cfg.Schema != "" {
		if _, err := conn.ExecContext(ctx, st.Get("CreateSchema")); err != nil {
			return fmt.Errorf("sqlschema: Migrate: creating database %s: %w", cfg.Schema, err)
		}
	}
	if _, err := conn.ExecContext(ctx, st.Get("CreateMigrationsTable")); err != nil {
		return fmt.Errorf("sqlschema: Migrate: creating %s: %w", cfg.migrations(), err)
	}
	applied, err := appliedMigrations(ctx, connExec{conn}, st, cfg, migs)
	if err != nil {
		return fmt.Errorf("sqlschema: Migrate: %w", err)
	}
	for _, m := range migs {
		target := cfg.targetName(m.Target)
		if _, ok := applied[target+":"+strconv.Itoa(m.Version)]; ok {
			continue
		}
		for _, stmt := range splitStatements(m.SQL) {
			if _, err := conn.ExecContext(ctx, stmt); err != nil {
				return fmt.Errorf("sqlschema: Migrate: applying %s to %s: %w", m.Name, target, err)
			}
		}
		if _, err := conn.ExecContext(ctx, st.Get("RecordMigration"), target, m.Version, m.Name); err != nil {
			return fmt.Errorf("sqlschema: Migrate: recording %s: %w", m.Name, err)
		}
	}
	return checkLayout(ctx, connExec{conn}, st, cfg)
}

// splitStatements splits a MySQL migration into its statements: each ends
// with a line that ends in ";". Comment lines are dropped.
func splitStatements(script string) []string {
	var out []string
	var cur strings.Builder
	for _, line := range strings.Split(script, "\n") {
		trimmed := strings.TrimSpace(line)
		if strings.HasPrefix(trimmed, "--") || (trimmed == "" && cur.Len() == 0) {
			continue
		}
		cur.WriteString(line + "\n")
		if strings.HasSuffix(trimmed, ";") {
			out = append(out, strings.TrimSuffix(strings.TrimSpace(cur.String()), ";"))
			cur.Reset()
		}
	}
	if s := strings.TrimSpace(cur.String()); s != "" {
		out = append(out, s)
	}
	return out
}

// minMariaDB and minMySQL are the first versions with SKIP LOCKED, which
// the relay's claim needs.
var (
	minMariaDB = [2]int{10, 6}
	minMySQL   = [2]int{8, 0}
)

// checkServer reports whether the server has what the library needs (SKIP
// LOCKED) and the connection scans DATETIME into time.Time (parseTime=true).
func checkServer(ctx context.Context, q interface {
	QueryRowContext(ctx context.Context, query string, args ...any) *stdsql.Row
}, st sqlfile.Statements) error {
	var version string
	var now any
	if err := q.QueryRowContext(ctx, st.Get("ServerVersion")).Scan(&version, &now); err != nil {
		return fmt.Errorf("reading the server's version: %w", err)
	}
	if _, ok := now.(time.Time); !ok {
		return fmt.Errorf("%w: the DSN must have parseTime=true (DATETIME values arrive as %T)", ErrEngine, now)
	}
	return checkVersion(version)
}

// checkVersion parses version() and compares it with minMariaDB or minMySQL.
func checkVersion(version string) error {
	min, engine := minMySQL, "MySQL"
	if strings.Contains(strings.ToLower(version), "mariadb") {
		min, engine = minMariaDB, "MariaDB"
	}
	parts := strings.SplitN(strings.SplitN(version, "-", 2)[0], ".", 3)
	if len(parts) < 2 {
		return fmt.Errorf("%w: cannot read the server version %q", ErrEngine, version)
	}
	major, err1 := strconv.Atoi(parts[0])
	minor, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil {
		return fmt.Errorf("%w: cannot read the server version %q", ErrEngine, version)
	}
	if major < min[0] || (major == min[0] && minor < min[1]) {
		return fmt.Errorf("%w: %s %s has no SKIP LOCKED, %d.%d or later is needed", ErrEngine, engine, version, min[0], min[1])
	}
	return nil
}

// checkConn is checkServer, and the found-rows probe, on one connection.
func checkConn(ctx context.Context, conn *stdsql.Conn, st sqlfile.Statements) error {
	if err := checkServer(ctx, conn, st); err != nil {
		return err
	}
	if _, err := conn.ExecContext(ctx, st.Get("ProbeCreate")); err != nil {
		return fmt.Errorf("the found-rows probe: %w", err)
	}
	defer func() { _, _ = conn.ExecContext(context.WithoutCancel(ctx), st.Get("ProbeDrop")) }()
	var n int64
	for range 2 {
		res, err := conn.ExecContext(ctx, st.Get("ProbeUpsert"))
		if err != nil {
			return fmt.Errorf("the found-rows probe: %w", err)
		}
		if n, err = res.RowsAffected(); err != nil {
			return fmt.Errorf("the found-rows probe: %w", err)
		}
	}
	if n != 0 {
		return fmt.Errorf("%w: the DSN must not set clientFoundRows=true (an upsert that changes nothing must report 0 rows)", ErrEngine)
	}
	return nil
}

// CheckConn reports whether db's connection can serve the library, as far
// as the connection itself decides it: on MySQL, a server with SKIP LOCKED,
// a DSN with parseTime=true and without clientFoundRows=true (the claims
// tell a new record from an existing one by the affected rows of an
// upsert). Errors wrap ErrEngine, or are the database's. On PostgreSQL it
// checks nothing. Migrate and Check run it; the middleware runs it once
// before its first claim.
func CheckConn(ctx context.Context, db DB) error {
	if err := db.checkConn(ctx); err != nil {
		return fmt.Errorf("sqlschema: %w", err)
	}
	return nil
}

// checkConn is CheckConn without the package's prefix.
func (c DB) checkConn(ctx context.Context) error {
	if c.Dialect != MySQL {
		return nil
	}
	if err := c.validateConn(); err != nil {
		return err
	}
	st, err := c.bookkeeping()
	if err != nil {
		return err
	}
	sdb, _ := stdDB(c.Conn)
	conn, err := sdb.Conn(ctx)
	if err != nil {
		return fmt.Errorf("connecting: %w", err)
	}
	defer func() { _ = conn.Close() }()
	return checkConn(ctx, conn, st)
}

// connExec runs the bookkeeping's queries on one connection.
type connExec struct{ c *stdsql.Conn }

func (e connExec) ExecContext(ctx context.Context, q string, args ...any) (wsql.Result, error) {
	return e.c.ExecContext(ctx, q, args...)
}

func (e connExec) QueryContext(ctx context.Context, q string, args ...any) (wsql.Rows, error) {
	return e.c.QueryContext(ctx, q, args...)
}

var _ wsql.ContextExecutor = connExec{}
