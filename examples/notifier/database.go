package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// database is the notifier's connection: a pgx pool on PostgreSQL, a
// database/sql pool of go-sql-driver/mysql on MySQL or MariaDB. Past
// opening, everything goes through conn.Conn (wsql.Beginner), whichever the
// engine: the library, and the notifier's own statements (st).
type database struct {
	conn  sqlschema.DB // Conn and Dialect; the caller sets Schema
	ping  func(context.Context) error
	close func()
}

// dialectOf is the database engine a DATABASE_URL names: MySQL for
// mysql://..., else PostgreSQL (a postgres:// URL or a pgx connection
// string).
func dialectOf(databaseURL string) sqlschema.Dialect {
	if strings.HasPrefix(strings.ToLower(databaseURL), "mysql://") {
		return sqlschema.MySQL
	}
	return sqlschema.Postgres
}

// openDatabase opens the database of databaseURL lazily: it connects on
// first use (ping). maxIdle is how many idle connections a MySQL pool
// keeps (database/sql's default, 2, would reconnect under load).
func openDatabase(ctx context.Context, databaseURL string, maxIdle int) (*database, error) {
	if dialectOf(databaseURL) == sqlschema.MySQL {
		cfg, err := mysqlConfig(databaseURL)
		if err != nil {
			return nil, err
		}
		connector, err := mysql.NewConnector(cfg)
		if err != nil {
			return nil, err
		}
		db := sql.OpenDB(connector)
		db.SetMaxIdleConns(maxIdle)
		// Retire connections before the server's wait_timeout or a proxy
		// closes them idle (go-sql-driver's recommendation).
		db.SetConnMaxLifetime(3 * time.Minute)
		return &database{
			conn:  sqlschema.DB{Conn: wsql.BeginnerFromStdSQL(db), Dialect: sqlschema.MySQL},
			ping:  db.PingContext,
			close: func() { _ = db.Close() },
		}, nil
	}
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		return nil, err
	}
	return &database{
		conn:  sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Dialect: sqlschema.Postgres},
		ping:  pool.Ping,
		close: pool.Close,
	}, nil
}

// mysqlConfig converts mysql://user:password@host:port/database?params into
// go-sql-driver/mysql's configuration. The query parameters are the
// driver's (tls, timeout, ...) or system variables to set; parseTime=true,
// which the library needs (DATETIME columns scanned into time.Time), and
// loc=UTC are set unless the URL sets them. The port defaults to 3306.
func mysqlConfig(databaseURL string) (*mysql.Config, error) {
	u, err := url.Parse(databaseURL)
	if err != nil {
		return nil, fmt.Errorf("not a valid mysql:// URL: %w", err)
	}
	q := u.Query()
	if !q.Has("parseTime") {
		q.Set("parseTime", "true")
	}
	if !q.Has("loc") {
		q.Set("loc", "UTC")
	}
	cfg, err := mysql.ParseDSN("/?" + q.Encode()) // the parameters, read as the driver reads a DSN's
	if err != nil {
		return nil, fmt.Errorf("the mysql:// URL's parameters: %w", err)
	}
	if !cfg.ParseTime {
		return nil, errors.New("the mysql:// URL sets parseTime=false: the notifier needs parseTime=true")
	}
	if u.User != nil {
		cfg.User = u.User.Username()
		cfg.Passwd, _ = u.User.Password()
	}
	host, port := u.Hostname(), u.Port()
	if host == "" {
		host = "localhost"
	}
	if port == "" {
		port = "3306"
	}
	cfg.Net, cfg.Addr = "tcp", net.JoinHostPort(host, port)
	cfg.DBName = strings.TrimPrefix(u.Path, "/")
	return cfg, nil
}

// handlerTx is the middleware's transaction of the message being handled
// (see exactlyonce.PgxTxFromContext), as a wsql.Tx whichever the driver.
// Do not commit or roll it back: the middleware does.
func handlerTx(ctx context.Context, dialect sqlschema.Dialect) (wsql.Tx, error) {
	if dialect == sqlschema.MySQL {
		tx, err := exactlyonce.StdTxFromContext(ctx)
		if err != nil {
			return nil, err
		}
		return wsql.TxFromStdSQL(tx), nil
	}
	tx, err := exactlyonce.PgxTxFromContext(ctx)
	if err != nil {
		return nil, err
	}
	return wsql.TxFromPgx(tx), nil
}

// queryRow runs query on q and scans its first row into dest; found is
// false when it returned none.
func queryRow(ctx context.Context, q wsql.ContextExecutor, query string, args []any, dest ...any) (found bool, err error) {
	rows, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return false, err
	}
	defer func() { _ = rows.Close() }()
	if !rows.Next() {
		return false, rowsErr(rows)
	}
	if err := rows.Scan(dest...); err != nil {
		return false, err
	}
	return true, rowsErr(rows)
}

// rowsErr is the error that ended rows, if any: both drivers' rows have
// Err, which wsql.Rows does not show (and its pgx Close drops).
func rowsErr(rows wsql.Rows) error {
	if r, ok := rows.(interface{ Err() error }); ok {
		return r.Err()
	}
	return nil
}

// engineName names the database engine in messages.
func engineName(d sqlschema.Dialect) string {
	if d == sqlschema.MySQL {
		return "MySQL/MariaDB"
	}
	return "PostgreSQL"
}
