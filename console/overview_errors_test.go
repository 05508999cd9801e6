package console

import (
	"context"
	"net/http"
	"net/url"
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The overview says of a database it cannot reach what every other
// endpoint says (unavailable, see the server's log), never the driver's
// error: that names the database role, the database and the address, and
// the overview is shown to every signed-in user. The log has the detail,
// once per computation.
func TestOverviewHidesConnectionDetails(t *testing.T) {
	t.Parallel()
	const role, dbname = "eo_secret_role_x7", "eo_secret_db_x7"
	u, err := url.Parse(testenv.DatabaseURL())
	require.NoError(t, err)
	server := u.Host // of the test database
	for _, c := range []struct {
		name, url string
		secrets   []string
	}{
		// Nothing listens there: connection refused.
		{"refused", "postgres://" + role + "@127.0.0.1:1/" + dbname + "?sslmode=disable&connect_timeout=1", []string{role, dbname, "127.0.0.1:1"}},
		// The server answers: no such database.
		{"no such database", "postgres://postgres@" + server + "/" + dbname + "?sslmode=disable&connect_timeout=5", []string{dbname, server}},
	} {
		for _, driver := range []string{"pgxpool", "database-sql"} {
			for _, named := range []bool{false, true} {
				name := c.name + "/" + driver
				if named {
					name += "/consumers"
				}
				t.Run(name, func(t *testing.T) {
					t.Parallel()
					e := envWith(t, Config{DB: sqlschema.DB{Conn: unreachable(t, driver, c.url)}}, func(cfg *Config) {
						if named {
							cfg.Consumers = []string{"charge-order"}
						}
					})
					e.settle()
					w := e.get("/eo/api/v1/overview")
					var doc overviewJSON
					decode(t, w, &doc)
					require.NotEmpty(t, doc.Errors)
					page := e.get("/eo/")
					require.Equal(t, http.StatusOK, page.Code)
					require.Contains(t, page.Body.String(), `<p class="error">Error: `)
					outbox := e.get("/eo/api/v1/outbox")
					apiErr(t, outbox, http.StatusServiceUnavailable, codeUnavailable)
					for _, s := range c.secrets {
						require.NotContains(t, w.Body.String(), s, "the overview's JSON")
						require.NotContains(t, page.Body.String(), s, "the overview's page")
						require.NotContains(t, outbox.Body.String(), s, "the outbox's figures")
					}
					require.Contains(t, w.Body.String(), "cannot be reached; see the server's log", "what the other endpoints say")
					if named {
						require.Len(t, doc.Consumers, 1)
						require.Contains(t, doc.Consumers[0].Error, "cannot be reached; see the server's log")
					}

					// The log has the detail, logged by the computation,
					// not by each request.
					lines := e.logs.lines(t, "exactlyonce console: computing the overview's figures")
					require.NotEmpty(t, lines)
					n := len(lines)
					require.Contains(t, lines[0]["error"], dbname, "the log says which database")
					e.get("/eo/api/v1/overview")
					e.get("/eo/")
					require.Len(t, e.logs.lines(t, "exactlyonce console: computing the overview's figures"), n, "not logged again per request")
				})
			}
		}
	}
}

// unreachable opens driver's connection to url without connecting.
func unreachable(t *testing.T, driver, url string) wsql.Beginner {
	t.Helper()
	switch driver {
	case "pgxpool":
		pool, err := pgxpool.New(context.Background(), url)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		return wsql.BeginnerFromPgx(pool)
	default:
		cfg, err := pgx.ParseConfig(url)
		require.NoError(t, err)
		db := stdlib.OpenDB(*cfg)
		t.Cleanup(func() { _ = db.Close() })
		return wsql.BeginnerFromStdSQL(db)
	}
}
