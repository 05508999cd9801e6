package console

import (
	"encoding/base64"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The login form's session cookie expires: it says so (Max-Age), and a
// cookie older than Config.SessionTTL (12 hours by default) no longer
// authenticates; a copied cookie is not good forever.
func TestSessionExpires(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	w := e.call("POST", "/eo/login", url.Values{"token": {testToken}, "next": {"/eo/"}}, "Authorization", "")
	require.Equal(t, http.StatusSeeOther, w.Code)
	c := w.Result().Cookies()[0]
	require.Equal(t, 12*60*60, c.MaxAge, "the cookie says when it expires")
}

// The expiry, on the handler's clock; a forged or tampered cookie; the
// configured lifetime.
func TestSessionExpiresOnTheClock(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) {
		c.SessionTTL = time.Hour
		c.SignInFailures = 100 // the forged cookies are failed sign-ins, over the default limit
	})
	h := e.h.(*handler)
	now := time.Now()
	h.now = func() time.Time { return now }
	w := e.call("POST", "/eo/login", url.Values{"token": {testToken}, "next": {"/eo/"}}, "Authorization", "")
	c := w.Result().Cookies()[0]
	require.Equal(t, 3600, c.MaxAge)
	cookie := cookieName + "=" + c.Value
	ok(t, e.get("/eo/api/v1/relays", "Authorization", "", "Cookie", cookie))

	now = now.Add(59 * time.Minute)
	ok(t, e.get("/eo/api/v1/relays", "Authorization", "", "Cookie", cookie))
	now = now.Add(time.Minute)
	apiErr(t, e.get("/eo/api/v1/relays", "Authorization", "", "Cookie", cookie), http.StatusUnauthorized, codeUnauthenticated)
	require.Equal(t, http.StatusUnauthorized, e.get("/eo/", "Authorization", "", "Cookie", cookie).Code, "the pages ask to sign in again")

	// Forged: another issue time with the MAC of the first, another
	// user's name with it, a cookie of the future, another token's, parts
	// missing.
	b := h.cfg.Auth.(*bearerAuth)
	u := &b.users[0]
	parts := strings.Split(c.Value, ".")
	require.Len(t, parts, 3, "name, issue time, MAC")
	name, issued, mac := parts[0], parts[1], parts[2]
	n, _ := strconv.ParseInt(issued, 10, 64)
	other := base64.RawURLEncoding.EncodeToString([]byte("alice"))
	for _, v := range []string{name + "." + strconv.FormatInt(n+3600, 10) + "." + mac, other + "." + issued + "." + mac, u.session(now.Add(time.Hour)),
		BearerToken("another-token-0123456789").(*bearerAuth).users[0].session(now),
		issued + "." + mac, name + "." + issued, "." + issued + "." + mac, name + ".x." + mac, "!." + issued + "." + mac} {
		apiErr(t, e.get("/eo/api/v1/relays", "Authorization", "", "Cookie", cookieName+"="+v), http.StatusUnauthorized, codeUnauthenticated)
	}
	ok(t, e.get("/eo/api/v1/relays", "Authorization", "", "Cookie", cookieName+"="+u.session(now.Add(-time.Minute))))

	_, err := New(Config{DB: e.db, Auth: BearerToken(testToken), SessionTTL: -time.Second})
	require.ErrorContains(t, err, "Config.SessionTTL")
}
