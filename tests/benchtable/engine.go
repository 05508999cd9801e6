package main

import (
	"context"
	"database/sql"
	"embed"
	"fmt"
	"strings"
	"sync"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/internal/mysqldsn"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlfile"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The engine dimension (-engines): the router, relay and retention
// sections run their engine-neutral variants on each engine selected, in
// the same alternating rounds, through the same code: the engine is a
// parameter of a run, not a copied section. PostgreSQL is reached through
// pgx (the fast path the library takes there); MariaDB through
// go-sql-driver/mysql and database/sql (the only path on MySQL), each
// section in a fresh database (sqlschema.DB.Schema) dropped by cleanup.
// The statements of both engines live in queries/<dialect>/*.sql.

// engine is a database engine the sections can run on.
type engine string

const (
	postgres engine = "postgres"
	mariadb  engine = "mariadb"
)

// allEngines is the -engines default, in the order lines are printed.
var allEngines = []engine{postgres, mariadb}

// mysql reports whether e is reached with the MySQL dialect. The zero
// engine is PostgreSQL (the sections that have no engine dimension).
func (e engine) mysql() bool { return e == mariadb }

// suffix is what a line or a variant of e carries after its name.
func (e engine) suffix() string {
	if e == "" {
		return " · " + string(postgres)
	}
	return " · " + string(e)
}

func parseEngines(s string) ([]engine, error) {
	var out []engine
	for _, f := range strings.Split(s, ",") {
		e := engine(strings.ToLower(strings.TrimSpace(f)))
		switch e {
		case "":
			continue
		case postgres, mariadb:
		case "mysql":
			e = mariadb
		default:
			return nil, fmt.Errorf("-engines: unknown engine %q (postgres, mariadb)", f)
		}
		for _, have := range out {
			if have == e {
				return nil, fmt.Errorf("-engines: %s given twice", e)
			}
		}
		out = append(out, e)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("-engines: want postgres, mariadb or both, got %q", s)
	}
	return out, nil
}

// hasEngine reports whether e is among the engines of this run.
func (c *config) hasEngine(e engine) bool {
	for _, have := range c.engines {
		if have == e {
			return true
		}
	}
	return false
}

// dbConn is a section's connection to one engine: a pgx pool on
// PostgreSQL, a database/sql handle on MariaDB.
type dbConn struct {
	engine engine
	pg     *pgxpool.Pool
	std    *sql.DB
}

// beginner is the connection as the library takes it (sqlschema.DB.Conn).
func (c *dbConn) beginner() wsql.Beginner {
	if c.std != nil {
		return wsql.BeginnerFromStdSQL(c.std)
	}
	return wsql.BeginnerFromPgx(c.pg)
}

func (c *dbConn) exec(ctx context.Context, q string, args ...any) error {
	if c.std != nil {
		_, err := c.std.ExecContext(ctx, q, args...)
		return err
	}
	_, err := c.pg.Exec(ctx, q, args...)
	return err
}

func (c *dbConn) count(ctx context.Context, q string, args ...any) (int64, error) {
	var n int64
	if c.std != nil {
		err := c.std.QueryRowContext(ctx, q, args...).Scan(&n)
		return n, err
	}
	err := c.pg.QueryRow(ctx, q, args...).Scan(&n)
	return n, err
}

func (c *dbConn) close() {
	if c.std != nil {
		_ = c.std.Close()
	}
	if c.pg != nil {
		c.pg.Close()
	}
}

// openConn connects to engine e with at most maxConns connections; with
// trace non-nil, every statement sent through it is counted (-stmts).
func (h *harness) openConn(ctx context.Context, e engine, maxConns int, trace *stmtTrace) (*dbConn, error) {
	if e.mysql() {
		db, err := openMySQL(ctx, h.cfg.mysqlURL, maxConns, trace)
		if err != nil {
			return nil, err
		}
		return &dbConn{engine: e, std: db}, nil
	}
	pool, err := newPoolTraced(ctx, h.cfg.dbURL, maxConns, "", trace)
	if err != nil {
		return nil, err
	}
	return &dbConn{engine: postgres, pg: pool}, nil
}

// openMySQL is a database/sql handle (go-sql-driver/mysql) to the server of
// rawURL (a mysql:// URL, or a DSN) with maxConns connections, all kept
// open when idle (database/sql keeps 2 by default: the others would be
// reconnected at each burst).
func openMySQL(ctx context.Context, rawURL string, maxConns int, trace *stmtTrace) (*sql.DB, error) {
	dsn := rawURL
	if mysqldsn.IsURL(rawURL) {
		var err error
		if dsn, err = mysqldsn.FromURL(rawURL); err != nil {
			return nil, err
		}
	}
	mc, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, fmt.Errorf("MySQL DSN: %w", err)
	}
	connector, err := mysql.NewConnector(mc)
	if err != nil {
		return nil, err
	}
	var db *sql.DB
	if trace != nil {
		db = sql.OpenDB(&tracedConnector{Connector: connector, trace: trace})
	} else {
		db = sql.OpenDB(connector)
	}
	db.SetMaxOpenConns(maxConns)
	db.SetMaxIdleConns(maxConns)
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := db.PingContext(pctx); err != nil {
		_ = db.Close()
		mc.Passwd = ""
		return nil, fmt.Errorf("MariaDB at %s: %w (make services; MYSQL_URL)", mc.Addr, err)
	}
	return db, nil
}

// adminConn is the harness's own connection to e (set-up, checks, fills),
// never traced.
func (h *harness) adminConn(e engine) *dbConn {
	if e.mysql() {
		return &dbConn{engine: mariadb, std: h.myAdmin}
	}
	return &dbConn{engine: postgres, pg: h.admin}
}

// newSchemaOn creates a schema (on MariaDB a database) with the library's
// tables, dropped by cleanup.
func (h *harness) newSchemaOn(ctx context.Context, e engine, name string) (sqlschema.DB, error) {
	if !e.mysql() {
		return h.newSchema(ctx, name)
	}
	s := strings.ToLower("benchtable_" + name + "_" + h.id)
	h.databases = append(h.databases, s)
	db := sqlschema.DB{Conn: wsql.BeginnerFromStdSQL(h.myAdmin), Dialect: sqlschema.MySQL, Schema: s}
	if err := sqlschema.Migrate(ctx, db); err != nil {
		return db, err
	}
	return db.WithDefaults(), nil
}

// queryFiles holds the statements of the engine-dimension sections, one
// directory per dialect.
//
//go:embed queries
var queryFiles embed.FS

var (
	queriesOnce sync.Once
	queriesErr  error
	queries     map[string]map[string]sqlfile.Statement // dir -> name -> statement
)

// sqlData is what the statements of queries/ may name; each statement
// renders with the fields it uses.
type sqlData struct {
	Table    string // any one quoted table
	Business string // the router's business table
	Inbox    string
	Outbox   string
	Database string // a quoted database (MariaDB)
	From, To int    // a range of a sequence (MariaDB: the seq_From_to_To table)

	Partitioned bool
}

// sqlText renders e's statement name with data.
func sqlText(e engine, name string, data sqlData) (string, error) {
	queriesOnce.Do(func() {
		queries = map[string]map[string]sqlfile.Statement{}
		for _, dir := range []string{"postgres", "mysql"} {
			files, err := queryFiles.ReadDir("queries/" + dir)
			if err != nil {
				queriesErr = err
				return
			}
			queries[dir] = map[string]sqlfile.Statement{}
			for _, f := range files {
				src, err := queryFiles.ReadFile("queries/" + dir + "/" + f.Name())
				if err != nil {
					queriesErr = err
					return
				}
				sts, err := sqlfile.Parse(src)
				if err != nil {
					queriesErr = fmt.Errorf("queries/%s/%s: %w", dir, f.Name(), err)
					return
				}
				for _, st := range sts {
					if _, dup := queries[dir][st.Name]; dup {
						queriesErr = fmt.Errorf("queries/%s: statement %q defined twice", dir, st.Name)
						return
					}
					queries[dir][st.Name] = st
				}
			}
		}
	})
	if queriesErr != nil {
		return "", queriesErr
	}
	dir := "postgres"
	if e.mysql() {
		dir = "mysql"
	}
	st, ok := queries[dir][name]
	if !ok {
		return "", fmt.Errorf("queries/%s: no statement %q", dir, name)
	}
	return sqlfile.Execute(st, data)
}

// mustSQL is sqlText for the statements every run renders: a missing or
// broken one is a bug of this program, found by its first run.
func mustSQL(e engine, name string, data sqlData) string {
	q, err := sqlText(e, name, data)
	if err != nil {
		panic(err)
	}
	return q
}
