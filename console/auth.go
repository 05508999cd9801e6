package console

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/hex"
	"errors"
	"net/http"
	"net/url"
	"path"
	"strconv"
	"strings"
	"time"
)

// Authenticator decides who a request comes from. Authenticate returns the
// user's name (it is logged with every action) and true, or false when the
// request is not authenticated: the API then answers 401, and the pages
// ask the browser to sign in (a login form for BearerToken, the browser's
// prompt for BasicAuth).
type Authenticator interface {
	Authenticate(r *http.Request) (user string, ok bool)
}

// MinTokenLength is the shortest token BearerToken accepts.
const MinTokenLength = 16

// DefaultSessionTTL is how long the session cookie of BearerToken's
// login form authenticates, by default (Config.SessionTTL).
const DefaultSessionTTL = 12 * time.Hour

// cookieName is the session cookie of BearerToken's login form.
const cookieName = "exactlyonce_console"

// tokenUser is the user a BearerToken request acts as: the token is
// shared, so the name says how it signed in.
const tokenUser = "token"

// BearerToken authenticates requests that carry this token: the API's
// clients in an "Authorization: Bearer <token>" header; browsers through
// the console's login form, which sets an HttpOnly, SameSite=Strict
// session cookie: its issue time and a MAC keyed by the token, good for
// Config.SessionTTL (12 hours by default; changing the token signs every
// browser out; signing out clears the browser's cookie, and a copy of it
// stays good until it expires). Comparisons take constant time. The token must be at
// least MinTokenLength bytes long (New says so): generate one, e.g.
// `openssl rand -hex 32`. Actions are logged as user "token".
func BearerToken(token string) Authenticator {
	mac := hmac.New(sha256.New, []byte(token))
	mac.Write([]byte("exactlyonce console session key v2"))
	return &bearerAuth{sum: sha256.Sum256([]byte(token)), key: mac.Sum(nil), n: len(token)}
}

type bearerAuth struct {
	sum [32]byte
	key []byte // of the session cookies' MACs, derived from the token
	n   int
}

// session is the value of a session cookie issued at t: the issue time
// (Unix seconds) and its MAC.
func (b *bearerAuth) session(t time.Time) string {
	issued := strconv.FormatInt(t.Unix(), 10)
	return issued + "." + b.sessionMAC(issued)
}

func (b *bearerAuth) sessionMAC(issued string) string {
	mac := hmac.New(sha256.New, b.key)
	mac.Write([]byte("session|" + issued))
	return hex.EncodeToString(mac.Sum(nil))
}

// validSession reports whether v is a session cookie of this token,
// issued less than ttl before now (and not after it, but for a minute of
// clock skew).
func (b *bearerAuth) validSession(v string, now time.Time, ttl time.Duration) bool {
	issued, mac, ok := strings.Cut(v, ".")
	if !ok || subtle.ConstantTimeCompare([]byte(mac), []byte(b.sessionMAC(issued))) != 1 {
		return false
	}
	sec, err := strconv.ParseInt(issued, 10, 64)
	if err != nil {
		return false
	}
	at := time.Unix(sec, 0)
	return now.Sub(at) < ttl && at.Before(now.Add(time.Minute))
}

func (b *bearerAuth) validate() error {
	if b.n < MinTokenLength {
		return errors.New("the bearer token is shorter than 16 bytes: generate a long random one (openssl rand -hex 32)")
	}
	return nil
}

// check reports whether token is the token, in constant time.
func (b *bearerAuth) check(token string) bool {
	sum := sha256.Sum256([]byte(token))
	return subtle.ConstantTimeCompare(sum[:], b.sum[:]) == 1
}

func (b *bearerAuth) Authenticate(r *http.Request) (string, bool) {
	return b.authenticate(r, time.Now(), DefaultSessionTTL)
}

// authenticate is Authenticate at now, with session cookies good for ttl.
func (b *bearerAuth) authenticate(r *http.Request, now time.Time, ttl time.Duration) (string, bool) {
	if v := r.Header.Get("Authorization"); v != "" {
		scheme, token, _ := strings.Cut(v, " ")
		return tokenUser, strings.EqualFold(scheme, "Bearer") && b.check(strings.TrimSpace(token))
	}
	if c, err := r.Cookie(cookieName); err == nil {
		return tokenUser, b.validSession(c.Value, now, ttl)
	}
	return "", false
}

// BasicAuth authenticates requests with HTTP basic credentials: the
// browser prompts for them (WWW-Authenticate), API clients send them
// (curl -u user:password). Comparisons take constant time. Actions are
// logged with the user name. Serve the console over TLS (or on a
// loopback address): basic credentials travel in clear.
func BasicAuth(user, password string) Authenticator {
	return &basicAuth{user: sha256.Sum256([]byte(user)), password: sha256.Sum256([]byte(password)), name: user, empty: user == "" || password == ""}
}

type basicAuth struct {
	user, password [32]byte
	name           string
	empty          bool
}

func (b *basicAuth) validate() error {
	if b.empty {
		return errors.New("BasicAuth needs a user name and a password")
	}
	return nil
}

func (b *basicAuth) Authenticate(r *http.Request) (string, bool) {
	u, p, ok := r.BasicAuth()
	if !ok {
		return "", false
	}
	us, ps := sha256.Sum256([]byte(u)), sha256.Sum256([]byte(p))
	good := subtle.ConstantTimeCompare(us[:], b.user[:]) & subtle.ConstantTimeCompare(ps[:], b.password[:])
	return b.name, good == 1
}

// AuthFunc authenticates with f: use it when your own middleware, in
// front of the console's handler, has authenticated the request and put
// the identity in its context; f reads it from there. f returns the
// user's name and true, or false: the console then answers 401 (your
// middleware should have sent the user to sign in before that).
func AuthFunc(f func(r *http.Request) (user string, ok bool)) Authenticator {
	return authFunc(f)
}

type authFunc func(r *http.Request) (string, bool)

func (f authFunc) Authenticate(r *http.Request) (string, bool) { return f(r) }

func (f authFunc) validate() error {
	if f == nil {
		return errors.New("AuthFunc(nil)")
	}
	return nil
}

type userKey struct{}

func withUser(ctx context.Context, user string) context.Context {
	return context.WithValue(ctx, userKey{}, user)
}

// userOf is the user the request was authenticated as.
func userOf(r *http.Request) string {
	u, _ := r.Context().Value(userKey{}).(string)
	return u
}

// authenticate returns the request's user.
func (h *handler) authenticate(r *http.Request) (string, bool) {
	if h.insecure {
		return "anonymous", true
	}
	var user string
	var ok bool
	if b, bearer := h.cfg.Auth.(*bearerAuth); bearer {
		user, ok = b.authenticate(r, h.now(), h.cfg.SessionTTL)
	} else {
		user, ok = h.cfg.Auth.Authenticate(r)
	}
	if !ok {
		return "", false
	}
	if user == "" {
		user = "(unnamed)"
	}
	return user, true
}

// unauthenticated answers a request that is not authenticated: 401, as
// JSON for the API; a login form (BearerToken), the browser's prompt
// (BasicAuth) or a page that says so for the pages.
//
// A request that carried credentials (an Authorization header, the
// session cookie), or that AuthFunc refused, is logged as a refusal; one
// without (a browser's first visit) is not.
func (h *handler) unauthenticated(w http.ResponseWriter, r *http.Request, api bool) {
	_, cookieErr := r.Cookie(cookieName)
	_, byFunc := h.cfg.Auth.(authFunc)
	if r.Header.Get("Authorization") != "" || cookieErr == nil || byFunc {
		h.logRefusal(r, http.StatusUnauthorized, codeUnauthenticated, "not authenticated: the credentials are wrong (or expired)")
	}
	switch h.cfg.Auth.(type) {
	case *bearerAuth:
		w.Header().Set("WWW-Authenticate", `Bearer realm="exactlyonce console"`)
	case *basicAuth:
		w.Header().Set("WWW-Authenticate", `Basic realm="exactlyonce console", charset="UTF-8"`)
	}
	if api {
		writeError(w, &apiError{status: http.StatusUnauthorized, code: codeUnauthenticated,
			message: "not authenticated: send the console's credentials (Authorization: Bearer <token>, or basic credentials)"})
		return
	}
	if _, ok := h.cfg.Auth.(*bearerAuth); ok {
		next := h.prefix + "/"
		if r.Method == http.MethodGet {
			next = r.URL.RequestURI()
		}
		h.render(w, r, http.StatusUnauthorized, "login", "Sign in", loginData{Next: next})
		return
	}
	h.render(w, r, http.StatusUnauthorized, "notice", "Sign in required", noticeData{
		Heading: "Sign in required",
		Text:    "This console needs you to be signed in. Reload the page to be asked for your credentials.",
	})
}

// public serves what needs no authentication: the style sheet, the
// script and the login form. It reports whether it served r.
func (h *handler) public(w http.ResponseWriter, r *http.Request) bool {
	p, ok := strings.CutPrefix(r.URL.Path, h.prefix)
	if !ok {
		return false
	}
	if name, ok := strings.CutPrefix(p, "/static/"); ok && safeMethod(r.Method) {
		serveStatic(w, r, name)
		return true
	}
	if p != "/login" {
		return false
	}
	b, ok := h.cfg.Auth.(*bearerAuth)
	if !ok {
		http.Redirect(w, r, h.prefix+"/", http.StatusSeeOther)
		return true
	}
	switch r.Method {
	case http.MethodGet, http.MethodHead:
		h.render(w, r, http.StatusOK, "login", "Sign in", loginData{Next: h.safeNext(r.URL.Query().Get("next"))})
	case http.MethodPost:
		if err := h.cop.Check(r); err != nil {
			h.refuse(w, r, false, http.StatusForbidden, codeCrossOrigin, "refused: the sign-in comes from another site")
			return true
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxBody)
		next := h.safeNext(r.PostFormValue("next"))
		if !b.check(r.PostFormValue("token")) {
			h.log.Warn("exactlyonce console: a sign-in with a wrong token", "remote_addr", r.RemoteAddr, "method", r.Method, "path", r.URL.Path,
				"status", http.StatusUnauthorized, "code", codeUnauthenticated)
			h.render(w, r, http.StatusUnauthorized, "login", "Sign in", loginData{Next: next, Failed: true})
			return true
		}
		http.SetCookie(w, &http.Cookie{Name: cookieName, Value: b.session(h.now()), Path: h.prefix + "/", HttpOnly: true,
			MaxAge: int(h.cfg.SessionTTL / time.Second), SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil || r.Header.Get("X-Forwarded-Proto") == "https"})
		h.log.Info("exactlyonce console: signed in", "user", tokenUser, "remote_addr", r.RemoteAddr)
		http.Redirect(w, r, next, http.StatusSeeOther)
	default:
		w.Header().Set("Allow", "GET, HEAD, POST")
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
	}
	return true
}

// logout clears the session cookie.
func (h *handler) logout(w http.ResponseWriter, r *http.Request) {
	http.SetCookie(w, &http.Cookie{Name: cookieName, Value: "", Path: h.prefix + "/", MaxAge: -1, HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil || r.Header.Get("X-Forwarded-Proto") == "https"})
	http.Redirect(w, r, h.prefix+"/login", http.StatusSeeOther)
}

// sessionPath reports whether path signs in or out: allowed in read-only
// mode.
func (h *handler) sessionPath(path string) bool {
	return path == h.prefix+"/logout" || path == h.prefix+"/login"
}

// safeNext is where a sign-in returns to: next when it is a page of the
// console's own, rebuilt from its escaped path and query; else the
// overview. Never another site: next must parse as a path alone (no
// scheme, host or user), hold no control character (a browser drops tabs
// and newlines, "/\t/evil.example" is "//evil.example" to it) and no
// backslash (a slash to a browser), and its path, cleaned, must be under
// the prefix.
func (h *handler) safeNext(next string) string {
	home := h.prefix + "/"
	if strings.ContainsFunc(next, func(c rune) bool { return c < 0x20 || c == 0x7f || c == '\\' }) {
		return home
	}
	u, err := url.Parse(next)
	if err != nil || u.Scheme != "" || u.Host != "" || u.User != nil || u.Opaque != "" || !strings.HasPrefix(u.Path, "/") {
		return home
	}
	if !strings.HasPrefix(path.Clean(u.Path), home) {
		return home
	}
	out := u.EscapedPath()
	if strings.HasPrefix(out, "//") || !strings.HasPrefix(out, "/") {
		return home
	}
	if u.RawQuery != "" {
		out += "?" + u.RawQuery
	}
	return out
}
