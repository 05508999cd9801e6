package console

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// hostCall sends a request addressed to host (its Host header), with no
// credentials, and hdr.
func hostCall(e *tenv, method, host, path, body string, hdr ...string) *httptest.ResponseRecorder {
	var r *http.Request
	if body == "" {
		r = httptest.NewRequest(method, "http://"+host+path, nil)
	} else {
		r = httptest.NewRequest(method, "http://"+host+path, strings.NewReader(body))
		r.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		r.Header.Set(hdr[i], hdr[i+1])
	}
	w := httptest.NewRecorder()
	e.h.ServeHTTP(w, r)
	return w
}

// Without authentication, the console answers only to the names of the
// loopback (and Config.AllowedHosts): a page of another site whose name
// resolves to the loopback (DNS rebinding) is the console's own origin
// to the browser, and would read the payloads and post actions.
func TestInsecureRefusesOtherHosts(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.Auth, c.InsecureNoAuth = nil, true })
	e.park("c", "k1", pmsg{topic: "t", payload: []byte("secret-payload")})

	w := hostCall(e, "GET", "attacker.example:8089", "/eo/api/v1/parked/c/k1", "", "Sec-Fetch-Site", "same-origin")
	apiErr(t, w, http.StatusMisdirectedRequest, codeMisdirected)
	require.NotContains(t, w.Body.String(), "secret-payload")
	w = hostCall(e, "POST", "attacker.example:8089", "/eo/api/v1/parked/c/k1/discard", `{"forget": true}`,
		"Sec-Fetch-Site", "same-origin", "Origin", "http://attacker.example:8089")
	apiErr(t, w, http.StatusMisdirectedRequest, codeMisdirected)
	require.Equal(t, "parked", e.status("c", "k1"), "nothing discarded")
	for _, p := range []string{"/eo/", "/eo/parked/c/k1", "/eo/static/console.js", "/eo/login", "/eo"} {
		w = hostCall(e, "GET", "attacker.example:8089", p, "")
		require.Equal(t, http.StatusMisdirectedRequest, w.Code, p)
		require.NotContains(t, w.Body.String(), "secret-payload")
	}
	for _, host := range []string{"127.0.0.1.attacker.example", "localhost.attacker.example:8089", "127.1:8089", "", "[::1%25lo]:8089", "0.0.0.0:8089"} {
		r := httptest.NewRequest("GET", "/eo/api/v1/parked/c/k1", nil)
		r.Host = host
		w = httptest.NewRecorder()
		e.h.ServeHTTP(w, r)
		apiErr(t, w, http.StatusMisdirectedRequest, codeMisdirected)
	}

	// The loopback's names are served.
	for _, host := range []string{"127.0.0.1:8089", "127.0.0.1", "[::1]:8089", "localhost:8089", "LocalHost", "127.0.0.2:1", "[::ffff:127.0.0.1]:80"} {
		r := httptest.NewRequest("GET", "/eo/api/v1/parked/c/k1", nil)
		r.Host = host
		w = httptest.NewRecorder()
		e.h.ServeHTTP(w, r)
		require.Equal(t, http.StatusOK, w.Code, "%s: %s", host, w.Body)
	}

	// Config.AllowedHosts adds names: with a port, that port only.
	f := envWith(t, Config{DB: e.db}, func(c *Config) {
		c.Auth, c.InsecureNoAuth, c.AllowedHosts = nil, true, []string{"Console.Internal:8089", "ops.example"}
	})
	for host, want := range map[string]int{
		"console.internal:8089": http.StatusOK, "console.internal:8090": http.StatusMisdirectedRequest, "console.internal": http.StatusMisdirectedRequest,
		"ops.example": http.StatusOK, "ops.example:443": http.StatusOK, "127.0.0.1:1": http.StatusOK, "attacker.example": http.StatusMisdirectedRequest,
	} {
		require.Equal(t, want, hostCall(f, "GET", host, "/eo/api/v1/relays", "").Code, host)
	}
}

// With authentication, Config.AllowedHosts (when set) is enforced too;
// without it, any name is served (the credentials are the defence).
func TestAllowedHostsWithAuth(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.AllowedHosts = []string{"ops.example.com"} })
	apiErr(t, hostCall(e, "GET", "other.example", "/eo/api/v1/relays", "", "Authorization", "Bearer "+testToken), http.StatusMisdirectedRequest, codeMisdirected)
	ok(t, hostCall(e, "GET", "ops.example.com", "/eo/api/v1/relays", "", "Authorization", "Bearer "+testToken))
	f := envWith(t, Config{DB: e.db})
	ok(t, hostCall(f, "GET", "any.example", "/eo/api/v1/relays", "", "Authorization", "Bearer "+testToken))

	for _, bad := range []string{"", "http://ops.example.com", "ops.example.com/eo", "ops example", "ops.example.com:port"} {
		_, err := New(Config{DB: e.db, Auth: BearerToken(testToken), AllowedHosts: []string{bad}})
		require.ErrorContains(t, err, "Config.AllowedHosts", bad)
	}
}
