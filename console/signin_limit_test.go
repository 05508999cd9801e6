package console

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

const (
	testPassword = "alice-long-passphrase"
	clientA      = "192.0.2.1:1234"
	clientB      = "198.51.100.7:5555"
)

func basicHeader(user, password string) string {
	r := httptest.NewRequest("GET", "/", nil)
	r.SetBasicAuth(user, password)
	return r.Header.Get("Authorization")
}

// clock is a handler's clock, moved by the test.
type clock struct{ now time.Time }

func (c *clock) set(h http.Handler) *clock {
	c.now = time.Date(2026, 3, 1, 9, 0, 0, 0, time.UTC)
	h.(*handler).now = func() time.Time { return c.now }
	return c
}

// requireTooMany asserts a 429 refusal with Retry-After (seconds).
func requireTooMany(t *testing.T, w *httptest.ResponseRecorder, api bool, retryAfter string) {
	t.Helper()
	if api {
		apiErr(t, w, http.StatusTooManyRequests, codeTooManyFailures)
	} else {
		require.Equal(t, http.StatusTooManyRequests, w.Code, "%s", w.Body)
	}
	require.Contains(t, w.Body.String(), "too many failed sign-ins from your address")
	require.Equal(t, retryAfter, w.Header().Get("Retry-After"))
}

// BasicAuth refuses a short password at New, with what to do.
func TestBasicAuthMinimumLength(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	_, err := New(Config{DB: e.db, Auth: BasicAuth("alice", "s")})
	require.ErrorContains(t, err, "console: New: Config.Auth: BasicAuth: the password is shorter than 16 bytes")
	_, err = New(Config{DB: e.db, Auth: BasicAuth("alice", strings.Repeat("p", MinPasswordLength-1))})
	require.ErrorContains(t, err, "shorter than 16 bytes")
	_, err = New(Config{DB: e.db, Auth: BasicAuth("alice", strings.Repeat("p", MinPasswordLength))})
	require.NoError(t, err)
}

// After 10 failed sign-ins of a client within 15 minutes, its requests
// with credentials are refused (429, Retry-After), the right ones too,
// until the window that began with its first failure has passed; another
// client is not; a success does not reset the count; the refusals are
// logged at warn.
func TestSignInLimitBasicAuth(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.Auth = BasicAuth("alice", testPassword) })
	clk := new(clock).set(e.h)
	right, wrong := basicHeader("alice", testPassword), basicHeader("alice", "wrong-guess-0123456789")

	ok(t, e.get("/eo/api/v1/relays", "Authorization", right, "RemoteAddr", clientA))
	for i := range DefaultSignInFailures {
		clk.now = clk.now.Add(time.Second)
		apiErr(t, e.get("/eo/api/v1/relays", "Authorization", wrong, "RemoteAddr", clientA), http.StatusUnauthorized, codeUnauthenticated)
		if i < DefaultSignInFailures-1 {
			ok(t, e.get("/eo/api/v1/relays", "Authorization", right, "RemoteAddr", clientA))
		}
	}
	// The window began with the first failure, a second after the start.
	requireTooMany(t, e.get("/eo/api/v1/relays", "Authorization", right, "RemoteAddr", clientA), true, "891")
	requireTooMany(t, e.get("/eo/", "Authorization", right, "RemoteAddr", "192.0.2.1:4321"), false, "891")
	requireRefusal(t, e, "", "GET", "/eo/", codeTooManyFailures)
	// Nothing is checked: a wrong password gets the same answer and is
	// not counted.
	requireTooMany(t, e.get("/eo/api/v1/relays", "Authorization", wrong, "RemoteAddr", clientA), true, "891")
	// A request without credentials (a browser's first visit) is asked
	// to sign in.
	require.Equal(t, http.StatusUnauthorized, e.get("/eo/", "Authorization", "", "RemoteAddr", clientA).Code)
	require.Equal(t, http.StatusOK, e.get("/eo/static/console.css", "Authorization", "", "RemoteAddr", clientA).Code)

	// Another client is not affected.
	ok(t, e.get("/eo/api/v1/relays", "Authorization", right, "RemoteAddr", clientB))
	apiErr(t, e.get("/eo/api/v1/relays", "Authorization", wrong, "RemoteAddr", clientB), http.StatusUnauthorized, codeUnauthenticated)
	ok(t, e.get("/eo/api/v1/relays", "Authorization", right, "RemoteAddr", clientB))

	// Until the window has passed.
	clk.now = clk.now.Add(15*time.Minute - 10*time.Second)
	requireTooMany(t, e.get("/eo/api/v1/relays", "Authorization", right, "RemoteAddr", clientA), true, "1")
	clk.now = clk.now.Add(time.Second)
	ok(t, e.get("/eo/api/v1/relays", "Authorization", right, "RemoteAddr", clientA))

	// A success does not reset the count: 9 failures, a success, a
	// failure are 10.
	for range DefaultSignInFailures - 1 {
		apiErr(t, e.get("/eo/api/v1/relays", "Authorization", wrong, "RemoteAddr", clientA), http.StatusUnauthorized, codeUnauthenticated)
	}
	ok(t, e.get("/eo/api/v1/relays", "Authorization", right, "RemoteAddr", clientA))
	apiErr(t, e.get("/eo/api/v1/relays", "Authorization", wrong, "RemoteAddr", clientA), http.StatusUnauthorized, codeUnauthenticated)
	requireTooMany(t, e.get("/eo/api/v1/relays", "Authorization", right, "RemoteAddr", clientA), true, "900")
}

// BearerToken's header, login form and session cookie are limited alike,
// and their failures count together: guessing a token is the same attack.
// A blocked client's browser signed in before keeps its session.
func TestSignInLimitBearerToken(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	clk := new(clock).set(e.h)
	bearer := "Bearer " + testToken
	form := func(token string) url.Values { return url.Values{"token": {token}, "next": {"/eo/"}} }

	// A session from before the guessing.
	w := e.call("POST", "/eo/login", form(testToken), "Authorization", "", "RemoteAddr", clientA)
	require.Equal(t, http.StatusSeeOther, w.Code)
	session := cookieName + "=" + w.Result().Cookies()[0].Value

	for i := range DefaultSignInFailures {
		switch i % 3 {
		case 0:
			apiErr(t, e.get("/eo/api/v1/relays", "Authorization", "Bearer wrong-token-0123456789", "RemoteAddr", clientA), http.StatusUnauthorized, codeUnauthenticated)
		case 1:
			require.Equal(t, http.StatusUnauthorized, e.call("POST", "/eo/login", form("wrong-token-0123456789"), "Authorization", "", "RemoteAddr", clientA).Code)
		case 2:
			require.Equal(t, http.StatusUnauthorized, e.get("/eo/", "Authorization", "", "Cookie", cookieName+"=forged", "RemoteAddr", clientA).Code)
		}
	}
	requireTooMany(t, e.get("/eo/api/v1/relays", "Authorization", bearer, "RemoteAddr", clientA), true, "900")
	w = e.call("POST", "/eo/login", form(testToken), "Authorization", "", "RemoteAddr", clientA)
	requireTooMany(t, w, false, "900")
	require.Empty(t, w.Result().Cookies(), "no session for a blocked client")
	requireRefusal(t, e, "", "POST", "/eo/login", codeTooManyFailures)
	requireTooMany(t, e.get("/eo/", "Authorization", "", "Cookie", cookieName+"=forged", "RemoteAddr", clientA), false, "900")
	// A session signed in before keeps working: its cookie is signed, no
	// guess forges it.
	ok(t, e.get("/eo/api/v1/relays", "Authorization", "", "Cookie", session, "RemoteAddr", clientA))
	require.Len(t, e.logs.lines(t, "exactlyonce console: a sign-in with a wrong token"), 3, "the form's failures are logged")

	ok(t, e.get("/eo/api/v1/relays", "Authorization", bearer, "RemoteAddr", clientB))
	require.Equal(t, http.StatusSeeOther, e.call("POST", "/eo/login", form(testToken), "Authorization", "", "RemoteAddr", clientB).Code)

	clk.now = clk.now.Add(DefaultSignInWindow)
	ok(t, e.get("/eo/api/v1/relays", "Authorization", bearer, "RemoteAddr", clientA))
	ok(t, e.get("/eo/api/v1/relays", "Authorization", "", "Cookie", session, "RemoteAddr", clientA))
}

// An IPv6 client is counted by its /64; the limit and its window are
// configurable, and can be turned off.
func TestSignInLimitConfig(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.SignInFailures, c.SignInWindow = 2, time.Minute })
	clk := new(clock).set(e.h)
	wrong := "Bearer wrong-token-0123456789"
	e.get("/eo/api/v1/relays", "Authorization", wrong, "RemoteAddr", "[2001:db8::1]:1000")
	e.get("/eo/api/v1/relays", "Authorization", wrong, "RemoteAddr", "[2001:db8::2]:1000")
	requireTooMany(t, e.get("/eo/api/v1/relays", "RemoteAddr", "[2001:db8::ffff]:2000"), true, "60")
	ok(t, e.get("/eo/api/v1/relays", "RemoteAddr", "[2001:db8:0:1::1]:1000"))
	clk.now = clk.now.Add(time.Minute)
	ok(t, e.get("/eo/api/v1/relays", "RemoteAddr", "[2001:db8::ffff]:2000"))

	f := newEnv(t, func(c *Config) { c.SignInFailures = -1 })
	for range 3 * DefaultSignInFailures {
		apiErr(t, f.get("/eo/api/v1/relays", "Authorization", wrong), http.StatusUnauthorized, codeUnauthenticated)
	}
	ok(t, f.get("/eo/api/v1/relays"))

	_, err := New(Config{DB: e.db, Auth: BearerToken(testToken), SignInWindow: -time.Second})
	require.ErrorContains(t, err, "Config.SignInWindow")
}

// The limit remembers at most its number of clients: past it, those whose
// window has passed are dropped, then the oldest.
func TestSignInLimitBounded(t *testing.T) {
	t.Parallel()
	l := newSignInLimit(2, time.Minute)
	l.clients = 3
	t0 := time.Date(2026, 3, 1, 9, 0, 0, 0, time.UTC)
	for i, c := range []string{"a", "b", "c"} {
		l.fail(c, t0.Add(time.Duration(i)*time.Second))
		l.fail(c, t0.Add(time.Duration(i)*time.Second))
	}
	_, blocked := l.blocked("a", t0.Add(10*time.Second))
	require.True(t, blocked)
	l.fail("d", t0.Add(10*time.Second))
	require.Len(t, l.records, 3)
	_, blocked = l.blocked("a", t0.Add(10*time.Second))
	require.False(t, blocked, "the oldest was dropped")
	for _, c := range []string{"b", "c"} {
		_, blocked = l.blocked(c, t0.Add(10*time.Second))
		require.True(t, blocked, c)
	}
	// Past the window, the expired records go first.
	l.fail("e", t0.Add(time.Minute+5*time.Second))
	require.Len(t, l.records, 2, "b and c expired; d and e remain")
	require.Contains(t, l.records, "d")
	require.Contains(t, l.records, "e")

	for addr, want := range map[string]string{
		"192.0.2.1:1234":            "192.0.2.1",
		"[::ffff:192.0.2.1]:1":      "192.0.2.1",
		"[2001:db8::1]:1":           "2001:db8::/64",
		"[fe80::1%eth0]:1":          "fe80::/64",
		"not an address":            "not an address",
		"@unix-socket-remote-addr":  "@unix-socket-remote-addr",
		"[2001:db8:1:2:3::9]:65535": "2001:db8:1:2::/64",
	} {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = addr
		require.Equal(t, want, clientOf(r), addr)
	}
}
