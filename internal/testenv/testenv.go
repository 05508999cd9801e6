// Package testenv connects tests to the real PostgreSQL and RabbitMQ that
// `make services` provides, and gives each test its own schema and queue
// names. A test that needs a service fails (never skips) when the service is
// unreachable, with a hint to run `make services`.
package testenv

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// DatabaseURL is $DATABASE_URL, or the loopback default.
func DatabaseURL() string {
	if u := os.Getenv("DATABASE_URL"); u != "" {
		return u
	}
	return "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"
}

// AMQPURL is $AMQP_URL, or the loopback default.
func AMQPURL() string {
	if u := os.Getenv("AMQP_URL"); u != "" {
		return u
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

const hint = " (is the service running? `make services` starts it; DATABASE_URL / AMQP_URL override the loopback defaults)"

// suiteURL is DatabaseURL asking for READ COMMITTED sessions
// (default_transaction_isolation, a startup parameter): the suite's own
// connections (Pool, StdDB, and the drivers and schemas made from them) do
// not depend on the database's or the role's default isolation, so that
// the suite passes against a database whose default is REPEATABLE READ. A
// test of the library under another level asks for it
// (DatabaseURLWithIsolation: a role's setting, with PoolFor and
// DriversFor), and the chaos suite runs the middleware under REPEATABLE
// READ. Through PgBouncer (DIRECT_DATABASE_URL set), which refuses unknown
// startup parameters, the URL is left as it is: PgBouncerConfig.ReadCommitted
// sets the level on its server connections instead.
func suiteURL() string {
	u := DatabaseURL()
	if os.Getenv("DIRECT_DATABASE_URL") != "" || strings.Contains(u, "default_transaction_isolation") {
		return u
	}
	sep := "?"
	if strings.Contains(u, "?") {
		sep = "&"
	}
	return u + sep + "default_transaction_isolation=read%20committed"
}

// Pool returns a pgx pool to the test database, closed at cleanup. Its
// sessions are READ COMMITTED whatever the database's default (suiteURL).
func Pool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return PoolFor(t, suiteURL())
}

// PoolFor returns a pgx pool to dbURL (at most 20 connections), closed at
// cleanup.
func PoolFor(t testing.TB, dbURL string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(dbURL)
	require.NoError(t, err)
	cfg.MaxConns = 20
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err, "PostgreSQL"+hint)
	require.NoError(t, pool.Ping(ctx), "PostgreSQL at "+dbURL+hint)
	t.Cleanup(pool.Close)
	return pool
}

// StdDB returns a database/sql handle (pgx's stdlib driver), closed at
// cleanup. Its sessions are READ COMMITTED whatever the database's default
// (suiteURL).
func StdDB(t testing.TB) *sql.DB {
	t.Helper()
	return StdDBFor(t, suiteURL())
}

// StdDBFor returns a database/sql handle (pgx's stdlib driver) to dbURL (at
// most 20 open connections), closed at cleanup.
func StdDBFor(t testing.TB, dbURL string) *sql.DB {
	t.Helper()
	cfg, err := pgx.ParseConfig(dbURL)
	require.NoError(t, err)
	db := stdlib.OpenDB(*cfg)
	db.SetMaxOpenConns(20)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	require.NoError(t, db.PingContext(ctx), "PostgreSQL at "+dbURL+hint)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

func wsqlPgx(p *pgxpool.Pool) wsql.Beginner { return wsql.BeginnerFromPgx(p) }
func wsqlStd(db *sql.DB) wsql.Beginner      { return wsql.BeginnerFromStdSQL(db) }

// Driver is one way of reaching a database through watermill-sql's seam:
// PostgreSQL through pgx or database/sql, or MySQL/MariaDB through
// database/sql (Dialect MySQL).
type Driver struct {
	Name    string
	DB      wsql.Beginner
	Dialect sqlschema.Dialect
}

// Drivers returns the pgxpool and database/sql drivers, so that a suite can
// run once per driver with t.Run(d.Name, ...).
func Drivers(t testing.TB) []Driver {
	t.Helper()
	return []Driver{
		{Name: "pgxpool", DB: wsql.BeginnerFromPgx(Pool(t))},
		{Name: "database-sql", DB: wsql.BeginnerFromStdSQL(StdDB(t))},
	}
}

// Unique returns prefix plus the sanitized test name and a random suffix,
// usable as a schema, table or queue name (at most 40 bytes).
func Unique(t testing.TB, prefix string) string {
	t.Helper()
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	name := strings.ToLower(regexp.MustCompile(`[^A-Za-z0-9]+`).ReplaceAllString(t.Name(), "_"))
	suffix := "_" + hex.EncodeToString(b)
	if max := 40 - len(prefix) - len(suffix); len(name) > max {
		name = name[len(name)-max:]
	}
	return prefix + strings.Trim(name, "_") + suffix
}

// Schema creates a fresh schema with the inbox and outbox tables (through
// sqlschema.Migrate) and drops it at cleanup. The DB's Conn is a pgx pool;
// set Conn to use another driver (see Drivers).
func Schema(t testing.TB) sqlschema.DB {
	t.Helper()
	pool := Pool(t)
	cfg := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: Unique(t, "eo_")}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, sqlschema.Migrate(ctx, cfg))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{cfg.Schema}.Sanitize()+" CASCADE")
		if err != nil {
			t.Errorf("dropping test schema %s: %v", cfg.Schema, err)
		}
	})
	return cfg
}

// Layouts names the inbox layouts a suite can run against: the plain table
// and the time-partitioned one (sqlschema.DB.Partitions).
var Layouts = []string{"plain", "partitioned"}

// SchemaLayout is Schema for the named layout (see Layouts). The
// partitioned one has daily partitions, two created ahead; for tests that
// write records by hand, its partition_at column gets the default
// clock_timestamp() (the library's table has none, so that a claim unaware
// of the layout fails instead of inserting; the library never relies on
// it).
func SchemaLayout(t testing.TB, layout string) sqlschema.DB {
	t.Helper()
	switch layout {
	case "plain":
		return Schema(t)
	case "partitioned":
		db := SchemaWith(t, sqlschema.DB{Partitions: &sqlschema.Partitioning{Interval: sqlschema.Daily, Ahead: 2}})
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := db.Conn.ExecContext(ctx, "ALTER TABLE "+db.Inbox()+" ALTER COLUMN partition_at SET DEFAULT clock_timestamp()")
		require.NoError(t, err)
		return db
	}
	t.Fatalf("unknown layout %q (want one of %v)", layout, Layouts)
	return sqlschema.DB{}
}

// SchemaWith is Schema with db's table names and layout (its Conn and
// Schema are set here).
func SchemaWith(t testing.TB, db sqlschema.DB) sqlschema.DB {
	t.Helper()
	pool := Pool(t)
	db.Conn = wsql.BeginnerFromPgx(pool)
	db.Schema = Unique(t, "eo_")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, sqlschema.Migrate(ctx, db))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{db.Schema}.Sanitize()+" CASCADE")
		if err != nil {
			t.Errorf("dropping test schema %s: %v", db.Schema, err)
		}
	})
	return db.WithDefaults()
}

// AMQPConn dials RabbitMQ with amqp091-go; closed at cleanup.
func AMQPConn(t testing.TB) *amqp.Connection {
	t.Helper()
	conn, err := amqp.Dial(AMQPURL())
	require.NoError(t, err, "RabbitMQ at "+AMQPURL()+hint)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// Queue returns a unique queue name, declares it durable, and deletes it at
// cleanup.
func Queue(t testing.TB, prefix string) string {
	t.Helper()
	name := Unique(t, prefix)
	conn := AMQPConn(t)
	ch, err := conn.Channel()
	require.NoError(t, err)
	_, err = ch.QueueDeclare(name, true, false, false, false, nil)
	require.NoError(t, err)
	require.NoError(t, ch.Close())
	t.Cleanup(func() {
		c, err := amqp.Dial(AMQPURL())
		if err != nil {
			t.Errorf("deleting queue %s: %v", name, err)
			return
		}
		defer func() { _ = c.Close() }()
		ch, err := c.Channel()
		if err != nil {
			t.Errorf("deleting queue %s: %v", name, err)
			return
		}
		_, _ = ch.QueueDelete(name, false, false, false)
		_, _ = ch.QueueDelete(name+"_poison", false, false, false)
	})
	return name
}
