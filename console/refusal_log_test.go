package console

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// refusals are the log lines of refused requests.
func refusals(t *testing.T, e *tenv) []map[string]any {
	t.Helper()
	return e.logs.lines(t, "exactlyonce console: refused")
}

// requireRefusal asserts that the last refusal logged is at warn, with
// the user (when known), the address, the method, the path and the code.
func requireRefusal(t *testing.T, e *tenv, user, method, path, code string) {
	t.Helper()
	lines := refusals(t, e)
	require.NotEmpty(t, lines, "a refusal is logged: %s", e.logs.String())
	l := lines[len(lines)-1]
	require.Equal(t, "WARN", l["level"])
	require.Equal(t, code, l["code"])
	require.Equal(t, method, l["method"])
	require.Equal(t, path, l["path"])
	require.NotEmpty(t, l["remote_addr"])
	if user == "" {
		require.NotContains(t, l, "user")
	} else {
		require.Equal(t, user, l["user"])
	}
}

// Every refusal of a request is logged at warn: read-only, cross-origin,
// failed authentication (with credentials), an empty filter of a bulk
// action, a name the console does not answer to; API and pages alike. A
// request without credentials (a browser's first visit) is not.
func TestRefusalsLogged(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.ReadOnly = true })
	e.park("c", "k1", pmsg{topic: "t"})

	e.call("POST", "/eo/api/v1/parked/c/k1/discard", nil)
	requireRefusal(t, e, "token", "POST", "/eo/api/v1/parked/c/k1/discard", codeReadOnly)
	e.call("POST", "/eo/parked/c/k1/discard", url.Values{"confirmed": {"1"}, "expect": {"1"}})
	requireRefusal(t, e, "token", "POST", "/eo/parked/c/k1/discard", codeReadOnly)

	f := newEnv(t, func(c *Config) { c.Auth = BasicAuth("alice", "s3cret-passphrase") })
	f.park("c", "k1", pmsg{topic: "t"})
	r := httptest.NewRequest("GET", "/", nil)
	r.SetBasicAuth("alice", "s3cret-passphrase")
	alice := r.Header.Get("Authorization")
	f.call("POST", "/eo/api/v1/parked/c/k1/discard", nil, "Authorization", alice, "Sec-Fetch-Site", "cross-site")
	requireRefusal(t, f, "alice", "POST", "/eo/api/v1/parked/c/k1/discard", codeCrossOrigin)
	f.call("POST", "/eo/parked/c/k1/discard", url.Values{"confirmed": {"1"}, "expect": {"1"}}, "Authorization", alice, "Origin", "https://evil.example")
	requireRefusal(t, f, "alice", "POST", "/eo/parked/c/k1/discard", codeCrossOrigin)
	r.SetBasicAuth("alice", "guess")
	f.get("/eo/api/v1/parked", "Authorization", r.Header.Get("Authorization"))
	requireRefusal(t, f, "", "GET", "/eo/api/v1/parked", codeUnauthenticated)
	f.get("/eo/parked", "Authorization", r.Header.Get("Authorization"))
	requireRefusal(t, f, "", "GET", "/eo/parked", codeUnauthenticated)
	n := len(refusals(t, f))
	f.get("/eo/parked", "Authorization", "")
	require.Len(t, refusals(t, f), n, "no credentials: a browser's first visit, not logged")

	e.get("/eo/api/v1/parked", "Authorization", "Bearer wrong-token-0123456789")
	requireRefusal(t, e, "", "GET", "/eo/api/v1/parked", codeUnauthenticated)
	e.get("/eo/", "Authorization", "", "Cookie", cookieName+"=forged")
	requireRefusal(t, e, "", "GET", "/eo/", codeUnauthenticated)
	e.call("POST", "/eo/login", url.Values{"token": {testToken}}, "Authorization", "", "Origin", "https://evil.example")
	requireRefusal(t, e, "", "POST", "/eo/login", codeCrossOrigin)

	// The empty filter of a bulk action.
	g := newEnv(t)
	g.park("c", "k1", pmsg{topic: "t"})
	g.call("POST", "/eo/api/v1/parked/discard", map[string]any{"expect": 1, "as_of": time.Now()})
	requireRefusal(t, g, "token", "POST", "/eo/api/v1/parked/discard", codeBadFilter)
	require.Contains(t, refusals(t, g)[0]["reason"], "the filter is empty")
	g.call("POST", "/eo/api/v1/outbox/rows/requeue", map[string]any{"expect": 0, "as_of": time.Now(), "max_id": 0})
	requireRefusal(t, g, "token", "POST", "/eo/api/v1/outbox/rows/requeue", codeBadFilter)

	// A name the console does not answer to.
	h := envWith(t, Config{DB: g.db}, func(c *Config) { c.Auth, c.InsecureNoAuth = nil, true })
	hostCall(h, "GET", "attacker.example", "/eo/api/v1/parked", "")
	requireRefusal(t, h, "", "GET", "/eo/api/v1/parked", codeMisdirected)
	require.Equal(t, http.StatusOK, hostCall(h, "GET", "127.0.0.1", "/eo/api/v1/relays", "").Code)
}
