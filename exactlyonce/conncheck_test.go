package exactlyonce_test

import (
	"database/sql"
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// On MySQL a DSN with clientFoundRows=true would make a claim take a
// record that exists for a new one (an upsert that changes nothing counts
// one row, as an insert). The middleware checks the connection before its
// first claim and refuses every claim on such a one: the handler never
// runs, the delivery is nacked with a configuration error.
func TestMySQLConnectionCheckedBeforeTheFirstClaim(t *testing.T) {
	t.Parallel()
	b := testenv.NewBundle(t, testenv.DriverNamed(t, testenv.MariaDB))
	mc, err := mysql.ParseDSN(testenv.MySQLDSN(testenv.MySQLURL()))
	require.NoError(t, err)
	mc.ClientFoundRows = true
	db, err := sql.Open("mysql", mc.FormatDSN())
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })

	tables := b.DB
	tables.Conn = wsql.BeginnerFromStdSQL(db)
	var ev testenv.Counters
	eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, Consumer: "c", NackDelay: -1, OnEvent: ev.Observe, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	runs := 0
	h := eo.Middleware(func(*message.Message) ([]*message.Message, error) { runs++; return nil, nil })
	for range 2 {
		_, err = h(message.NewMessage("m-1", nil))
		require.ErrorIs(t, err, exactlyonce.ErrClaimFailed)
		require.ErrorIs(t, err, sqlschema.ErrEngine)
		require.ErrorContains(t, err, "clientFoundRows")
	}
	require.Zero(t, runs)
	require.Zero(t, testenv.Count(t, b.Driver.DB, "SELECT count(*) FROM "+b.DB.Inbox()), "nothing claimed")

	// The same tables through a correct connection work.
	tables.Conn = b.Driver.DB
	eo, err = exactlyonce.New(exactlyonce.Config{DB: tables, Consumer: "c", NackDelay: -1, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	h = eo.Middleware(func(*message.Message) ([]*message.Message, error) { runs++; return nil, nil })
	_, err = h(message.NewMessage("m-1", nil))
	require.NoError(t, err)
	require.Equal(t, 1, runs)
}
