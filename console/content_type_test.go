package console

import (
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// An action of the API with a body takes JSON only, said so by its
// Content-Type: a form or text/plain post (what a page of another site
// can send without asking) is refused (415), a second defence behind the
// origin check. A bodyless action (curl -X POST) needs none; the pages
// post forms to their own routes.
func TestAPIActionsTakeJSONOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.park("c", "k1", pmsg{topic: "t"})
	for _, ct := range []string{"text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", "", "application/jsonx"} {
		r := httptest.NewRequest("POST", "http://console.test/eo/api/v1/parked/c/k1/discard", strings.NewReader(`{"forget": true}`))
		r.Header.Set("Authorization", "Bearer "+testToken)
		if ct != "" {
			r.Header.Set("Content-Type", ct)
		}
		w := httptest.NewRecorder()
		e.h.ServeHTTP(w, r)
		apiErr(t, w, http.StatusUnsupportedMediaType, codeUnsupportedMediaType)
		require.Equal(t, "parked", e.status("c", "k1"), "nothing done (%q)", ct)
	}
	apiErr(t, e.call("DELETE", "/eo/api/v1/consumers/c/keys/k1", url.Values{}), http.StatusUnsupportedMediaType, codeUnsupportedMediaType)
	requireRefusal(t, e, "token", "DELETE", "/eo/api/v1/consumers/c/keys/k1", codeUnsupportedMediaType)
	require.Equal(t, "parked", e.status("c", "k1"))

	ok(t, e.call("POST", "/eo/api/v1/parked/c/k1/discard", `{}`, "Content-Type", "application/json; charset=utf-8"))
	e.park("c", "k2", pmsg{topic: "t"})
	ok(t, e.call("POST", "/eo/api/v1/parked/c/k2/discard", nil))
	ok(t, e.get("/eo/api/v1/relays", "Content-Type", "text/plain")) // a GET is not an action
}
