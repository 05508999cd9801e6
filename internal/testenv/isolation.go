package testenv

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// Isolation levels a database or role may have as its default, as
// default_transaction_isolation spells them.
const (
	ReadCommitted  = "read committed"
	RepeatableRead = "repeatable read"
	Serializable   = "serializable"
)

// IsolationLevels lists the three levels PostgreSQL distinguishes.
var IsolationLevels = []string{ReadCommitted, RepeatableRead, Serializable}

// DatabaseURLWithIsolation returns a URL of the test database for a new
// login role whose default transaction isolation is level, as a shop sets
// it with ALTER ROLE ... SET default_transaction_isolation (the same setting
// ALTER DATABASE sets for everyone). See DatabaseURLWithRoleSettings.
func DatabaseURLWithIsolation(t testing.TB, level string) string {
	t.Helper()
	return DatabaseURLWithRoleSettings(t, map[string]string{"default_transaction_isolation": level})
}

// DatabaseURLWithRoleSettings returns a URL of the test database for a new
// login role with the given defaults (ALTER ROLE ... SET name = 'value').
// The role is a superuser, so it reaches every test schema; it is dropped at
// cleanup, its objects reassigned to the test's own user first.
//
// The URL reaches PostgreSQL itself (DirectDatabaseURL), also when the
// suite runs through PgBouncer: PgBouncer connects every client as one
// configured user, so a role's own settings would not apply through it.
func DatabaseURLWithRoleSettings(t testing.TB, settings map[string]string) string {
	t.Helper()
	pool := PoolFor(t, DirectDatabaseURL())
	role := Unique(t, "eo_role_")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	ident := pgx.Identifier{role}.Sanitize()
	_, err := pool.Exec(ctx, "CREATE ROLE "+ident+" LOGIN SUPERUSER")
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = pool.Exec(ctx, "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role)
		for _, q := range []string{"REASSIGN OWNED BY " + ident + " TO CURRENT_USER", "DROP OWNED BY " + ident, "DROP ROLE " + ident} {
			if _, err := pool.Exec(ctx, q); err != nil {
				t.Errorf("dropping test role %s: %s: %v", role, q, err)
				return
			}
		}
	})
	for name, value := range settings {
		_, err = pool.Exec(ctx, "ALTER ROLE "+ident+" SET "+pgx.Identifier{name}.Sanitize()+" = "+quoteLiteral(value))
		require.NoError(t, err)
	}
	u, err := url.Parse(DirectDatabaseURL())
	require.NoError(t, err)
	u.User = url.User(role)
	return u.String()
}

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// DriversFor returns the pgxpool and database/sql drivers (as Drivers) for
// dbURL instead of DatabaseURL.
func DriversFor(t testing.TB, dbURL string) []Driver {
	t.Helper()
	return []Driver{
		{Name: "pgxpool", DB: wsqlPgx(PoolFor(t, dbURL))},
		{Name: "database-sql", DB: wsqlStd(StdDBFor(t, dbURL))},
	}
}
