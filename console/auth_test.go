package console

import (
	"context"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// endpoint is one of the API's routes, with a path that reaches it.
type endpoint struct{ method, path string }

// endpoints are every route of the API.
var endpoints = []endpoint{
	{"GET", "/eo/api/v1/overview"},
	{"GET", "/eo/api/v1/consumers"},
	{"GET", "/eo/api/v1/consumers/ship-order"},
	{"GET", "/eo/api/v1/consumers/ship-order/keys/k1"},
	{"DELETE", "/eo/api/v1/consumers/ship-order/keys/k1"},
	{"GET", "/eo/api/v1/parked"},
	{"GET", "/eo/api/v1/parked/count"},
	{"POST", "/eo/api/v1/parked/replay"},
	{"POST", "/eo/api/v1/parked/discard"},
	{"GET", "/eo/api/v1/parked/ship-order/k1"},
	{"POST", "/eo/api/v1/parked/ship-order/k1/replay"},
	{"POST", "/eo/api/v1/parked/ship-order/k1/discard"},
	{"GET", "/eo/api/v1/outbox"},
	{"GET", "/eo/api/v1/outbox/rows"},
	{"GET", "/eo/api/v1/outbox/rows/count"},
	{"POST", "/eo/api/v1/outbox/rows/requeue"},
	{"POST", "/eo/api/v1/outbox/rows/discard"},
	{"GET", "/eo/api/v1/outbox/rows/1"},
	{"POST", "/eo/api/v1/outbox/rows/1/requeue"},
	{"POST", "/eo/api/v1/outbox/rows/1/discard"},
	{"GET", "/eo/api/v1/relays"},
}

// pages are the web console's pages and its forms' targets.
var pages = []endpoint{
	{"GET", "/eo/"},
	{"GET", "/eo/parked"},
	{"GET", "/eo/parked/ship-order/k1"},
	{"POST", "/eo/parked/ship-order/k1/replay"},
	{"POST", "/eo/parked/ship-order/k1/discard"},
	{"POST", "/eo/parked/replay"},
	{"POST", "/eo/parked/discard"},
	{"GET", "/eo/outbox"},
	{"POST", "/eo/outbox/requeue"},
	{"POST", "/eo/outbox/discard"},
	{"GET", "/eo/outbox/rows/1"},
	{"POST", "/eo/outbox/rows/1/requeue"},
	{"POST", "/eo/outbox/rows/1/discard"},
	{"GET", "/eo/inbox?consumer=ship-order&key=k1"},
	{"POST", "/eo/inbox/forget"},
}

func isAction(m string) bool { return m == "POST" || m == "DELETE" }

// New refuses a configuration that would serve without an
// authentication decision, or that it cannot serve.
func TestNewRefuses(t *testing.T) {
	t.Parallel()
	db := sqlschema.DB{Conn: testenv.DriverNamed(t, "pgxpool").DB}
	r := newRedis(t)
	for _, c := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"no store", Config{Auth: BearerToken(testToken)}, "Config.DB.Conn or Config.Redis is required"},
		{"no auth", Config{DB: db}, "Config.Auth is required"},
		{"both", Config{DB: db, Auth: BearerToken(testToken), InsecureNoAuth: true}, "choose one"},
		{"short token", Config{DB: db, Auth: BearerToken("short")}, "shorter than 16 bytes"},
		{"empty basic", Config{DB: db, Auth: BasicAuth("admin", "")}, "a user name and a password"},
		{"short password", Config{DB: db, Auth: BasicAuth("admin", "s3cret")}, "BasicAuth: the password is shorter than 16 bytes"},
		{"no tokens", Config{DB: db, Auth: BearerTokens(nil)}, "BearerTokens: no token"},
		{"unnamed token", Config{DB: db, Auth: BearerTokens(map[string]string{"": testToken})}, "BearerTokens: a token with an empty user name"},
		{"short named token", Config{DB: db, Auth: BearerTokens(map[string]string{"alice": testToken, "bot": "short"})}, `BearerTokens: the token of "bot" is shorter than 16 bytes`},
		{"shared token", Config{DB: db, Auth: BearerTokens(map[string]string{"alice": testToken, "bot": testToken})}, `BearerTokens: "alice" and "bot" have the same token`},
		{"nil func", Config{DB: db, Auth: AuthFunc(nil)}, "AuthFunc(nil)"},
		{"prefix", Config{DB: db, Auth: BearerToken(testToken), Prefix: "exactlyonce"}, "Config.Prefix"},
		{"prefix pattern", Config{DB: db, Auth: BearerToken(testToken), Prefix: "/a/{b}"}, "Config.Prefix"},
		{"consumers without DB", Config{Redis: r.store, Auth: BearerToken(testToken), Consumers: []string{"a"}}, "Config.RedisConsumers"},
		{"redis consumers without Redis", Config{DB: db, Auth: BearerToken(testToken), RedisConsumers: []string{"a"}}, "without Config.Redis"},
		{"nil Redis store", Config{Redis: (*redisstore.Store)(nil), Auth: BearerToken(testToken)}, "Config.DB.Conn or Config.Redis is required"},
		{"redis consumers with a nil Redis store", Config{DB: db, Redis: (*redisstore.Store)(nil), Auth: BearerToken(testToken), RedisConsumers: []string{"a"}}, "without Config.Redis"},
		{"empty consumer", Config{DB: db, Auth: BearerToken(testToken), Consumers: []string{""}}, "empty consumer name"},
		{"origin", Config{DB: db, Auth: BearerToken(testToken), TrustedOrigins: []string{"not an origin"}}, "TrustedOrigins"},
		{"interval", Config{DB: db, Auth: BearerToken(testToken), StatsInterval: -1}, "StatsInterval"},
		{"table name", Config{DB: sqlschema.DB{Conn: db.Conn, InboxTable: "bad name;"}, Auth: BearerToken(testToken)}, "Config.DB"},
	} {
		t.Run(c.name, func(t *testing.T) {
			h, err := New(c.cfg)
			require.Nil(t, h)
			require.ErrorContains(t, err, c.want)
		})
	}

	// The insecure option says so, loudly, at New.
	logs := &syncBuffer{}
	h, err := New(Config{DB: db, InsecureNoAuth: true, Logger: slog.New(slog.NewJSONHandler(logs, nil))})
	require.NoError(t, err)
	require.Contains(t, logs.String(), `"level":"WARN"`)
	require.Contains(t, logs.String(), "INSECURE")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", "http://127.0.0.1:8089/api/v1/relays", nil))
	require.Equal(t, http.StatusOK, w.Code, "served as anonymous: %s", w.Body)
}

// Nothing but the style sheet, the script and the login form is served
// without credentials: the API answers 401 JSON, the pages a login form.
func TestUnauthenticated(t *testing.T) {
	t.Parallel()
	// Some 70 wrong credentials from one address: over the default limit
	// of failed sign-ins (TestSignInLimit).
	e := newEnv(t, func(c *Config) { c.SignInFailures = 1000 })
	for _, ep := range endpoints {
		for _, auth := range []string{"", "Bearer wrong-token-0123456789", "Basic " + "YWRtaW46c2VjcmV0", "Bearer"} {
			w := e.call(ep.method, ep.path, nil, "Authorization", auth)
			apiErr(t, w, http.StatusUnauthorized, codeUnauthenticated)
			require.Equal(t, `Bearer realm="exactlyonce console"`, w.Header().Get("WWW-Authenticate"))
		}
	}
	for _, p := range pages {
		w := e.call(p.method, p.path, nil, "Authorization", "")
		require.Equal(t, http.StatusUnauthorized, w.Code, "%s %s", p.method, p.path)
		require.Contains(t, w.Body.String(), `<form id="login" method="post" action="/eo/login">`, "%s %s", p.method, p.path)
		require.Contains(t, w.Body.String(), "<h1>Sign in</h1>")
		require.NotContains(t, w.Body.String(), "<table")
	}
	// Public: the assets, the login form.
	for _, p := range []string{"/eo/static/console.css", "/eo/static/console.js", "/eo/login"} {
		w := e.get(p, "Authorization", "")
		require.Equal(t, http.StatusOK, w.Code, p)
	}
	require.Equal(t, http.StatusNotFound, e.get("/eo/static/other.txt", "Authorization", "").Code)
	require.Equal(t, http.StatusUnauthorized, e.get("/eo/no-such-page", "Authorization", "").Code, "unknown pages too")
	apiErr(t, e.get("/eo/api/v2/anything", "Authorization", ""), http.StatusUnauthorized, codeUnauthenticated)

	// With the token, every route is reached (none is the fallback's).
	for _, ep := range append(append([]endpoint{}, endpoints...), pages...) {
		w := e.call(ep.method, ep.path, nil)
		require.NotContains(t, w.Body.String(), "no such endpoint", "%s %s", ep.method, ep.path)
		require.NotContains(t, w.Body.String(), "There is no page at this address", "%s %s", ep.method, ep.path)
		require.NotEqual(t, http.StatusUnauthorized, w.Code)
		require.Less(t, w.Code, 500, "%s %s: %s", ep.method, ep.path, w.Body)
	}
}

// The login form sets an HttpOnly, SameSite=Strict cookie that
// authenticates the browser; a wrong token does not; the form only sends
// the user back to a page of the console; sign-out clears the cookie.
func TestLoginForm(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	form := url.Values{"token": {"wrong"}, "next": {"/eo/outbox"}}
	w := e.call("POST", "/eo/login", form, "Authorization", "")
	require.Equal(t, http.StatusUnauthorized, w.Code)
	require.Contains(t, w.Body.String(), `id="login-error"`)
	require.Empty(t, w.Result().Cookies())
	require.Len(t, e.logs.lines(t, "exactlyonce console: a sign-in with a wrong token"), 1)

	form.Set("token", testToken)
	w = e.call("POST", "/eo/login", form, "Authorization", "", "Origin", "https://evil.example")
	require.Equal(t, http.StatusForbidden, w.Code, "a sign-in from another site")

	w = e.call("POST", "/eo/login", form, "Authorization", "")
	require.Equal(t, http.StatusSeeOther, w.Code, "%s", w.Body)
	require.Equal(t, "/eo/outbox", w.Header().Get("Location"))
	cookies := w.Result().Cookies()
	require.Len(t, cookies, 1)
	c := cookies[0]
	require.Equal(t, cookieName, c.Name)
	require.True(t, c.HttpOnly)
	require.Equal(t, http.SameSiteStrictMode, c.SameSite)
	require.Equal(t, "/eo/", c.Path)
	require.NotContains(t, c.Value, testToken, "the cookie is not the token itself")

	cookie := c.Name + "=" + c.Value
	ok(t, e.get("/eo/api/v1/relays", "Authorization", "", "Cookie", cookie))
	w = e.get("/eo/", "Authorization", "", "Cookie", cookie)
	require.Equal(t, http.StatusOK, w.Code)
	require.Contains(t, w.Body.String(), "Signed in as <strong>token</strong>")
	apiErr(t, e.get("/eo/api/v1/relays", "Authorization", "", "Cookie", c.Name+"=forged"), http.StatusUnauthorized, codeUnauthenticated)

	// next: only the console's own pages.
	for next, want := range map[string]string{
		"/eo/parked?consumer=a": "/eo/parked?consumer=a",
		"https://evil.example/": "/eo/",
		"//evil.example/eo/":    "/eo/",
		"/eo/\\evil":            "/eo/",
		"/other/":               "/eo/",
	} {
		w := e.call("POST", "/eo/login", url.Values{"token": {testToken}, "next": {next}}, "Authorization", "")
		require.Equal(t, want, w.Header().Get("Location"), next)
	}

	w = e.call("POST", "/eo/logout", nil, "Authorization", "", "Cookie", cookie)
	require.Equal(t, http.StatusSeeOther, w.Code)
	require.Equal(t, -1, w.Result().Cookies()[0].MaxAge)
}

// BearerTokens: each token names its user, through the API's header as
// through the login form's session; the actions and the sign-ins are
// logged with that name. Changing one user's token signs out that user's
// browsers only.
func TestBearerTokens(t *testing.T) {
	t.Parallel()
	const botToken, aliceToken = "deploy-bot-token-0123456789", "alice-token-0123456789abcdef"
	tokens := map[string]string{"deploy-bot": botToken, "alice": aliceToken}
	e := newEnv(t, func(c *Config) { c.Auth = BearerTokens(tokens) })
	e.park("ship-order", "k1", pmsg{topic: "orders"})
	e.park("ship-order", "k2", pmsg{topic: "orders"})
	e.park("ship-order", "k3", pmsg{topic: "orders"})

	// The API's header.
	ok(t, e.call("POST", "/eo/api/v1/parked/ship-order/k1/discard", nil, "Authorization", "Bearer "+botToken))
	apiErr(t, e.get("/eo/api/v1/relays", "Authorization", "Bearer "+testToken), http.StatusUnauthorized, codeUnauthenticated)

	// The login form's session.
	login := func(token string) string {
		t.Helper()
		w := e.call("POST", "/eo/login", url.Values{"token": {token}, "next": {"/eo/"}}, "Authorization", "")
		require.Equal(t, http.StatusSeeOther, w.Code, "%s", w.Body)
		return cookieName + "=" + w.Result().Cookies()[0].Value
	}
	alice, bot := login(aliceToken), login(botToken)
	require.NotContains(t, alice, aliceToken)
	ok(t, e.call("POST", "/eo/api/v1/parked/ship-order/k2/discard", nil, "Authorization", "", "Cookie", alice))
	ok(t, e.call("POST", "/eo/api/v1/parked/ship-order/k3/discard", nil, "Authorization", "", "Cookie", bot))
	w := e.get("/eo/", "Authorization", "", "Cookie", alice)
	require.Equal(t, http.StatusOK, w.Code)
	require.Contains(t, w.Body.String(), "Signed in as <strong>alice</strong>")

	var users []string
	for _, l := range e.logs.lines(t, "exactlyonce console: action") {
		users = append(users, l["user"].(string)+" "+l["key"].(string))
	}
	require.Equal(t, []string{"deploy-bot k1", "alice k2", "deploy-bot k3"}, users)
	var signedIn []string
	for _, l := range e.logs.lines(t, "exactlyonce console: signed in") {
		signedIn = append(signedIn, l["user"].(string))
	}
	require.Equal(t, []string{"alice", "deploy-bot"}, signedIn)

	// alice's token changes: her session ends, the bot's does not.
	f := envWith(t, Config{DB: e.db}, func(c *Config) {
		c.Auth = BearerTokens(map[string]string{"deploy-bot": botToken, "alice": "alice-new-token-0123456789"})
	})
	apiErr(t, f.get("/eo/api/v1/relays", "Authorization", "", "Cookie", alice), http.StatusUnauthorized, codeUnauthenticated)
	ok(t, f.get("/eo/api/v1/relays", "Authorization", "", "Cookie", bot))
}

// BasicAuth: the browser is asked for credentials; actions are logged
// with the user's name. AuthFunc: the identity the user's middleware put
// in the context.
func TestBasicAuthAndAuthFunc(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.Auth = BasicAuth("alice", "s3cret-passphrase") })
	e.park("ship-order", "k1", pmsg{topic: "orders"})
	basic := func(u, p string) string {
		r := httptest.NewRequest("GET", "/", nil)
		r.SetBasicAuth(u, p)
		return r.Header.Get("Authorization")
	}
	w := e.get("/eo/", "Authorization", "")
	require.Equal(t, http.StatusUnauthorized, w.Code)
	require.Equal(t, `Basic realm="exactlyonce console", charset="UTF-8"`, w.Header().Get("WWW-Authenticate"))
	apiErr(t, e.get("/eo/api/v1/overview", "Authorization", basic("alice", "wrong")), http.StatusUnauthorized, codeUnauthenticated)
	apiErr(t, e.get("/eo/api/v1/overview", "Authorization", basic("bob", "s3cret-passphrase")), http.StatusUnauthorized, codeUnauthenticated)
	apiErr(t, e.get("/eo/api/v1/overview", "Authorization", "Bearer "+testToken), http.StatusUnauthorized, codeUnauthenticated)
	require.Equal(t, http.StatusSeeOther, e.get("/eo/login", "Authorization", "").Code, "no login form without a token: a redirect to the overview")

	m := ok(t, e.call("POST", "/eo/api/v1/parked/ship-order/k1/discard", nil, "Authorization", basic("alice", "s3cret-passphrase")))
	require.EqualValues(t, 1, m["discarded"])
	lines := e.logs.lines(t, "exactlyonce console: action")
	require.Len(t, lines, 1)
	require.Equal(t, "alice", lines[0]["user"])
	require.Equal(t, "parked.discard", lines[0]["action"])
	require.Equal(t, "ship-order", lines[0]["consumer"])
	require.EqualValues(t, 1, lines[0]["count"])

	type ctxUser struct{}
	f := newEnv(t, func(c *Config) {
		c.Auth = AuthFunc(func(r *http.Request) (string, bool) {
			u, ok := r.Context().Value(ctxUser{}).(string)
			return u, ok
		})
	})
	w = f.get("/eo/api/v1/overview")
	apiErr(t, w, http.StatusUnauthorized, codeUnauthenticated)
	require.Empty(t, w.Header().Get("WWW-Authenticate"))
	r := httptest.NewRequest("GET", "/eo/api/v1/relays", nil)
	r = r.WithContext(withUser(r.Context(), "ignored"))
	w = httptest.NewRecorder()
	f.h.ServeHTTP(w, r)
	require.Equal(t, http.StatusUnauthorized, w.Code, "the console's own context key is not the user's")
	mw := func(next http.Handler) http.Handler { // the user's middleware
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), ctxUser{}, "carol")))
		})
	}
	w = httptest.NewRecorder()
	mw(f.h).ServeHTTP(w, httptest.NewRequest("GET", "/eo/", nil))
	require.Equal(t, http.StatusOK, w.Code)
	require.Contains(t, w.Body.String(), "Signed in as <strong>carol</strong>")
}

// A read-only console refuses every action (403 read_only), changes
// nothing, and shows no action form.
func TestReadOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.ReadOnly = true })
	e.park("ship-order", "k1", pmsg{topic: "orders", payload: []byte("{}")})
	id := e.row("invoices", "u1", "{}", nil, "quarantined")
	for _, ep := range endpoints {
		if !isAction(ep.method) {
			continue
		}
		path := strings.Replace(ep.path, "/rows/1/", "/rows/"+itoa(id)+"/", 1)
		body := map[string]any{"consumer": "ship-order", "expect": 1}
		if strings.Contains(path, "/outbox/") {
			body = map[string]any{"all": true, "expect": 1}
		}
		apiErr(t, e.call(ep.method, path, body), http.StatusForbidden, codeReadOnly)
	}
	for _, p := range pages {
		if isAction(p.method) {
			w := e.call(p.method, p.path, url.Values{"store": {"postgres"}, "consumer": {"ship-order"}, "key": {"k1"}, "confirmed": {"1"}, "expect": {"1"}})
			require.Equal(t, http.StatusForbidden, w.Code, "%s %s", p.method, p.path)
			require.Contains(t, w.Body.String(), "read-only")
		}
	}
	require.Equal(t, "parked", e.status("ship-order", "k1"))
	_, err := e.store.GetParked(e.ctx, "ship-order", "k1")
	require.NoError(t, err, "the message is still there")
	require.EqualValues(t, 1, testenv.Count(t, e.db.Conn, `SELECT count(*) FROM `+e.db.Outbox()+` WHERE quarantined_at IS NOT NULL`))
	require.Empty(t, e.logs.lines(t, "exactlyonce console: action"))

	// The pages hide the forms and say why.
	for _, p := range []string{"/eo/parked/ship-order/k1", "/eo/parked?consumer=ship-order", "/eo/outbox/rows/" + itoa(id), "/eo/outbox", "/eo/inbox?consumer=ship-order&key=k1"} {
		w := e.get(p)
		require.Equal(t, http.StatusOK, w.Code, p)
		body := w.Body.String()
		require.Contains(t, body, `id="read-only"`)
		require.NotContains(t, body, `method="post" action="/eo/parked`, p)
		require.NotContains(t, body, `method="post" action="/eo/outbox`, p)
		require.NotContains(t, body, `method="post" action="/eo/inbox`, p)
	}
	// Signing out is not an action on the system.
	require.Equal(t, http.StatusSeeOther, e.call("POST", "/eo/logout", nil).Code)
}

// An action from another site is refused (403 cross_origin), whether the
// browser says so (Sec-Fetch-Site) or only sends a foreign Origin; a
// trusted origin is let through; GETs are never refused for it.
func TestCrossOrigin(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.TrustedOrigins = []string{"https://ops.example.com"} })
	e.park("ship-order", "k1", pmsg{topic: "orders"})
	for _, ep := range endpoints {
		if !isAction(ep.method) {
			continue
		}
		apiErr(t, e.call(ep.method, ep.path, nil, "Sec-Fetch-Site", "cross-site"), http.StatusForbidden, codeCrossOrigin)
		apiErr(t, e.call(ep.method, ep.path, nil, "Origin", "https://evil.example"), http.StatusForbidden, codeCrossOrigin)
	}
	for _, p := range pages {
		if !isAction(p.method) {
			continue
		}
		w := e.call(p.method, p.path, url.Values{"confirmed": {"1"}, "expect": {"1"}}, "Sec-Fetch-Site", "cross-site", "Cookie", "x=y")
		require.Equal(t, http.StatusForbidden, w.Code, "%s %s", p.method, p.path)
		require.Contains(t, w.Body.String(), "another site")
	}
	require.Equal(t, "parked", e.status("ship-order", "k1"))
	_, err := e.store.GetParked(e.ctx, "ship-order", "k1")
	require.NoError(t, err, "nothing changed")

	ok(t, e.get("/eo/api/v1/parked/ship-order/k1", "Sec-Fetch-Site", "cross-site"))
	// The console's own page, and a trusted origin, may act.
	w := e.call("POST", "/eo/api/v1/parked/ship-order/k1/discard", nil, "Sec-Fetch-Site", "same-origin", "Origin", "http://console.test")
	ok(t, w)
	e.park("ship-order", "k2", pmsg{topic: "orders"})
	ok(t, e.call("POST", "/eo/api/v1/parked/ship-order/k2/discard", nil, "Sec-Fetch-Site", "cross-site", "Origin", "https://ops.example.com"))
}

func itoa(n int64) string { return strconv.FormatInt(n, 10) }

// The tables of endpoints and pages name every route the handler
// registers, so that the tests that walk them cover every one.
func TestEveryRouteListed(t *testing.T) {
	t.Parallel()
	e := envWith(t, Config{Redis: newRedis(t).store})
	h := e.h.(*handler)
	registered := func(fn string) map[string]bool {
		src, err := os.ReadFile("routes.go")
		require.NoError(t, err)
		out := map[string]bool{}
		for _, m := range regexp.MustCompile(`\n\t`+fn+`\("(\w+) ([^"]+)"`).FindAllStringSubmatch(string(src), -1) {
			out[m[1]+" /eo"+map[string]string{"a": "/api/v1", "p": ""}[fn]+m[2]] = true
		}
		require.NotEmpty(t, out)
		return out
	}
	listed := func(mux *http.ServeMux, eps []endpoint) map[string]bool {
		out := map[string]bool{}
		for _, ep := range eps {
			_, pattern := mux.Handler(httptest.NewRequest(ep.method, ep.path, nil))
			out[pattern] = true
		}
		return out
	}
	require.Equal(t, registered("a"), listed(h.apiMux, endpoints))
	require.Equal(t, registered("p"), listed(h.mux, pages))
}
