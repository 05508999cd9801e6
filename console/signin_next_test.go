package console

import (
	"net/http"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"
)

// Where a sign-in returns to (next) is a page of the console: never
// another site, whatever a browser makes of the text (it drops tabs and
// newlines and reads a backslash as a slash: "/\t/evil.example" is
// "//evil.example" to it), with the prefix or without.
func TestLoginNextStaysOnConsole(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	root := envWith(t, Config{DB: e.db}, func(c *Config) { c.Prefix = "" })
	for _, c := range []struct {
		env       *tenv
		next      string
		want      string
		loginPath string
	}{
		{root, "/\t/evil.example", "/", "/login"},
		{root, "/\n/evil.example", "/", "/login"},
		{root, "/\r/evil.example", "/", "/login"},
		{root, "/\x0b/evil.example", "/", "/login"},
		{root, "/\\evil.example", "/", "/login"},
		{root, "/\t\\evil.example", "/", "/login"},
		{root, "//evil.example", "/", "/login"},
		{root, "https://evil.example/", "/", "/login"},
		{root, "javascript:alert(1)", "/", "/login"},
		{root, "/x@evil.example", "/x@evil.example", "/login"},
		{root, "/%2F%2Fevil.example", "/%2F%2Fevil.example", "/login"},
		{root, "/parked?consumer=a&meta=k:v", "/parked?consumer=a&meta=k:v", "/login"},
		{root, "/parked/c/a%2Fb", "/parked/c/a%2Fb", "/login"},
		{root, "/ /x", "/%20/x", "/login"},
		{root, "", "/", "/login"},
		{e, "/eo/../evil", "/eo/", "/eo/login"},
		{e, "/eo/%2E%2E/evil", "/eo/", "/eo/login"},
		{e, "/eo/\t/x", "/eo/", "/eo/login"},
		{e, "/eofoo", "/eo/", "/eo/login"},
		{e, "/eo/outbox?state=failing#frag", "/eo/outbox?state=failing", "/eo/login"},
	} {
		w := c.env.call("POST", c.loginPath, url.Values{"token": {testToken}, "next": {c.next}}, "Authorization", "")
		require.Equal(t, http.StatusSeeOther, w.Code, "%q", c.next)
		require.Equal(t, c.want, w.Header().Get("Location"), "next %q", c.next)
	}
}
