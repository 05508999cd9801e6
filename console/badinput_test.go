package console

import (
	"encoding/base64"
	"net/http"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"
)

// Input that no store can hold is refused as bad_filter, never a 500: a
// forged page cursor (a time out of range, a NUL in its consumer or key),
// a tenant with a NUL, a duration ago that overflows into the future.
func TestBadInputNever500(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.park("c", "k1", pmsg{topic: "t"})
	cursor := func(js string) string { return url.QueryEscape(base64.RawURLEncoding.EncodeToString([]byte(js))) }
	for _, p := range []string{
		"/eo/api/v1/parked?after=" + cursor(`{"t":-9000000000000000000,"c":"c","k":"k"}`),
		"/eo/api/v1/parked?after=" + cursor(`{"t":1,"c":"c\u0000","k":"k"}`),
		"/eo/api/v1/parked?consumer=c&after=" + cursor(`{"t":1,"c":"c","k":"k\u0000"}`),
		"/eo/api/v1/consumers/c/keys/k1?tenant=%00",
		"/eo/api/v1/consumers/c/keys/k1?tenant=%FF",
		"/eo/api/v1/parked?since=100000d2562047h",
		"/eo/api/v1/parked/count?before=2562047h1h",
		"/eo/api/v1/outbox/rows?since=100000d2562047h",
	} {
		apiErr(t, e.get(p), http.StatusBadRequest, codeBadFilter)
	}
	apiErr(t, e.call("DELETE", "/eo/api/v1/consumers/c/keys/k1?tenant=%00", nil), http.StatusBadRequest, codeBadFilter)
	require.Equal(t, "parked", e.status("c", "k1"))
	for _, p := range []string{
		"/eo/parked?consumer=c&after=" + cursor(`{"t":-9000000000000000000,"c":"c","k":"k"}`),
		"/eo/parked?consumer=c&after=" + cursor(`{"t":1,"c":"c","k":"k\u0000"}`),
		"/eo/inbox?consumer=c&key=k1&tenant=%00",
		"/eo/parked?since=100000d2562047h",
	} {
		page(t, e.get(p), http.StatusBadRequest)
	}
	require.Empty(t, e.logs.lines(t, "exactlyonce console: internal error"))
}
