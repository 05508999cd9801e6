package testenv

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// MariaDB is the driver name of MySQL/MariaDB in the engine matrix
// (go-sql-driver/mysql through database/sql, sqlschema.MySQL).
const MariaDB = "mariadb"

// EngineDriverNames are the drivers of the engine matrix: PostgreSQL's two
// (DriverNames) and MariaDB. A behaviour that holds on both engines is
// tested once, through ForEachEngine or EachEngine, against all three.
var EngineDriverNames = append(append([]string(nil), DriverNames...), MariaDB)

// ForEachEngine is ForEachDriver over EngineDriverNames: f runs once per
// driver of either engine (and per variant), as parallel subtests named
// "driver" or "driver/variant". The variant "partitioned" (Layouts) is
// PostgreSQL's only: MySQL refuses the layout at configuration
// (sqlschema's tests assert the refusal), so it is not generated for
// MariaDB.
func ForEachEngine(t *testing.T, variants []string, f func(t *testing.T, d Driver, variant string)) {
	t.Helper()
	forEach(t, EngineDriverNames, variants, f)
}

// EachEngine runs f once per driver of either engine (ForEachEngine), each
// with its own Bundle.
func EachEngine(t *testing.T, f func(t *testing.T, b *Bundle)) {
	t.Helper()
	ForEachEngine(t, nil, func(t *testing.T, d Driver, _ string) {
		f(t, NewBundle(t, d))
	})
}

// SchemaMySQL creates a fresh MySQL database (sqlschema.DB.Schema) with the
// inbox and outbox tables, reached through conn (wsql.BeginnerFromStdSQL
// of a MySQLDB), and drops it at cleanup.
func SchemaMySQL(t testing.TB, conn wsql.Beginner) sqlschema.DB {
	t.Helper()
	db := sqlschema.DB{Conn: conn, Dialect: sqlschema.MySQL, Schema: Unique(t, "eo_")}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	require.NoError(t, sqlschema.Migrate(ctx, db))
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := conn.ExecContext(ctx, "DROP DATABASE IF EXISTS "+QuoteMySQL(db.Schema)); err != nil {
			t.Errorf("dropping test database %s: %v", db.Schema, err)
		}
	})
	return db.WithDefaults()
}

// MySQLDriverWithIsolation returns the MariaDB driver whose connections
// have level (ReadCommitted, RepeatableRead, Serializable) as their
// session's default transaction isolation, as a shop sets it in the DSN or
// the server's configuration (MariaDB's tx_isolation; MySQL 8 calls it
// transaction_isolation).
func MySQLDriverWithIsolation(t testing.TB, level string) Driver {
	t.Helper()
	value := strings.ToUpper(strings.ReplaceAll(level, " ", "-"))
	dsn := MySQLDSN(MySQLURL())
	sep := "?"
	if strings.Contains(dsn, "?") {
		sep = "&"
	}
	db := MySQLDBFor(t, dsn+sep+"tx_isolation="+url.QueryEscape("'"+value+"'"))
	return Driver{Name: MariaDB, DB: wsql.BeginnerFromStdSQL(db), Dialect: sqlschema.MySQL}
}

// EngineDriversFor returns the drivers of either engine whose transactions
// default to level: PostgreSQL's (DriversFor a role with that default) and
// MariaDB's (MySQLDriverWithIsolation).
func EngineDriversFor(t testing.TB, level string) []Driver {
	t.Helper()
	return append(DriversFor(t, DatabaseURLWithIsolation(t, level)), MySQLDriverWithIsolation(t, level))
}
