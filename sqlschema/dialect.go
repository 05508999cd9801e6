package sqlschema

import (
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Dialect is the SQL engine behind DB.Conn: the library keeps one set of
// statements per dialect (docs/mysql.md lists where the engines differ).
type Dialect string

// The dialects.
const (
	// Postgres is PostgreSQL (tested on 15), through pgx/v5 or
	// database/sql. The default.
	Postgres Dialect = "postgres"
	// MySQL is MySQL (8.0.1 or later) or MariaDB (10.6 or later), through
	// github.com/go-sql-driver/mysql and database/sql
	// (wsql.BeginnerFromStdSQL), with parseTime=true in the DSN. Tested on
	// MariaDB 10.11.
	MySQL Dialect = "mysql"
)

// ErrUnsupported is wrapped by the errors of a configuration that the
// dialect cannot hold (the time-partitioned inbox on MySQL, say).
var ErrUnsupported = errors.New("not supported by this database engine")

// String names the dialect.
func (d Dialect) String() string {
	if d == "" {
		return string(Postgres)
	}
	return string(d)
}

func (d Dialect) validate() error {
	switch d {
	case "", Postgres, MySQL:
		return nil
	}
	return fmt.Errorf("sqlschema: DB.Dialect is %q, it must be sqlschema.Postgres or sqlschema.MySQL", string(d))
}

// QuoteIdentifier quotes the dot-less name parts as one qualified
// identifier of the dialect: "a"."b" for PostgreSQL, `a`.`b` for MySQL.
// Empty parts are left out.
func (d Dialect) QuoteIdentifier(parts ...string) string {
	var kept []string
	for _, p := range parts {
		if p != "" {
			kept = append(kept, p)
		}
	}
	if d == MySQL {
		for i, p := range kept {
			kept[i] = "`" + strings.ReplaceAll(p, "`", "``") + "`"
		}
		return strings.Join(kept, ".")
	}
	return pgx.Identifier(kept).Sanitize()
}

// ValidateConn reports whether Conn can reach a database of c's dialect,
// as far as it can tell without a round trip: on MySQL, Conn must be
// wsql.BeginnerFromStdSQL of a *sql.DB; a *sql.DB whose driver is
// go-sql-driver/mysql under the Postgres dialect (Dialect left empty) is
// refused with an error that says to set DB.Dialect. A nil Conn is
// refused.
func (c DB) ValidateConn() error {
	if err := c.validateConn(); err != nil {
		return fmt.Errorf("sqlschema: %w", err)
	}
	return nil
}

// validateConn is ValidateConn without the package's prefix.
func (c DB) validateConn() error {
	c = c.WithDefaults()
	if c.Conn == nil {
		return errors.New("DB.Conn is nil: set it to wsql.BeginnerFromPgx(pool) or wsql.BeginnerFromStdSQL(db)")
	}
	db, std := stdDB(c.Conn)
	mysqlDriver := std && strings.HasSuffix(fmt.Sprintf("%T", db.Driver()), "mysql.MySQLDriver")
	switch {
	case c.Dialect == MySQL && !std:
		return fmt.Errorf("DB.Dialect is MySQL, so DB.Conn must be wsql.BeginnerFromStdSQL(db) of a *sql.DB, not %T", c.Conn)
	case c.Dialect != MySQL && mysqlDriver:
		return errors.New("DB.Conn is a MySQL connection but DB.Dialect is Postgres: set DB.Dialect to sqlschema.MySQL")
	}
	return nil
}
