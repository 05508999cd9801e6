package console

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"path"
	"sort"
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

// MinTokenLength is the shortest token BearerToken and BearerTokens
// accept.
const MinTokenLength = 16

// MinPasswordLength is the shortest password BasicAuth accepts: the
// length of a token. A password guards the same actions as a token and is
// guessed the same way, and one a person chose holds less randomness per
// byte than a generated token: it gets no lower bar. A few words make
// one.
const MinPasswordLength = 16

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
// session cookie: the user, its issue time and a MAC keyed by the token,
// good for Config.SessionTTL (12 hours by default; changing the token
// signs every browser out; signing out clears the browser's cookie, and a
// copy of it stays good until it expires). Comparisons take constant
// time. The token must be at least MinTokenLength bytes long (New says
// so): generate one, e.g. `openssl rand -hex 32`. Failed sign-ins are
// limited per client address (Config.SignInFailures). Actions are logged
// as user "token": BearerTokens names a user per token.
func BearerToken(token string) Authenticator {
	return newBearerAuth(map[string]string{tokenUser: token}, true)
}

// BearerTokens authenticates as BearerToken does, with a token per user:
// tokens maps each user's name to its token. A request, or a browser
// signed in with the login form, acts as the user whose token it carries:
// actions are logged with that name. The session cookie names the user
// and is signed with that user's token, so that changing one token signs
// out that user's browsers only. Each token must be at least
// MinTokenLength bytes long and differ from the others, and each name
// must not be empty (New says so).
//
//	console.BearerTokens(map[string]string{
//		"deploy-bot": os.Getenv("CONSOLE_TOKEN_DEPLOY_BOT"),
//		"alice":      os.Getenv("CONSOLE_TOKEN_ALICE"),
//	})
func BearerTokens(tokens map[string]string) Authenticator {
	return newBearerAuth(tokens, false)
}

// bearerAuth is BearerToken's and BearerTokens' authenticator.
type bearerAuth struct {
	users  []bearerUser // by name
	byName map[string]*bearerUser
	err    error // what validate reports
}

// bearerUser is a user's token, as its digest, and the key of its
// session cookies' MACs, derived from it.
type bearerUser struct {
	name string
	sum  [32]byte
	key  []byte
}

func newBearerAuth(tokens map[string]string, single bool) *bearerAuth {
	b := &bearerAuth{byName: map[string]*bearerUser{}}
	names := make([]string, 0, len(tokens))
	for name := range tokens {
		names = append(names, name)
	}
	sort.Strings(names)
	seen := map[[32]byte]string{}
	for _, name := range names {
		token := tokens[name]
		switch {
		case b.err != nil:
		case single && len(token) < MinTokenLength:
			b.err = fmt.Errorf("the bearer token is shorter than %d bytes: generate a long random one (openssl rand -hex 32)", MinTokenLength)
		case name == "":
			b.err = errors.New("BearerTokens: a token with an empty user name: name each token's user")
		case len(token) < MinTokenLength:
			b.err = fmt.Errorf("BearerTokens: the token of %q is shorter than %d bytes: generate a long random one (openssl rand -hex 32)", name, MinTokenLength)
		}
		mac := hmac.New(sha256.New, []byte(token))
		mac.Write([]byte("exactlyonce console session key v3"))
		u := bearerUser{name: name, sum: sha256.Sum256([]byte(token)), key: mac.Sum(nil)}
		if other, dup := seen[u.sum]; dup && b.err == nil {
			b.err = fmt.Errorf("BearerTokens: %q and %q have the same token: give each user a token of its own", other, name)
		}
		seen[u.sum] = name
		b.users = append(b.users, u)
	}
	for i := range b.users {
		b.byName[b.users[i].name] = &b.users[i]
	}
	if len(b.users) == 0 {
		b.err = errors.New("BearerTokens: no token: give at least one user's")
	}
	return b
}

func (b *bearerAuth) validate() error { return b.err }

// session is the value of a session cookie of user issued at t: the
// user's name (base64url), the issue time (Unix seconds) and their MAC,
// keyed by the user's token.
func (u *bearerUser) session(t time.Time) string {
	issued := strconv.FormatInt(t.Unix(), 10)
	name := base64.RawURLEncoding.EncodeToString([]byte(u.name))
	return name + "." + issued + "." + u.sessionMAC(issued)
}

func (u *bearerUser) sessionMAC(issued string) string {
	mac := hmac.New(sha256.New, u.key)
	mac.Write([]byte("session|" + u.name + "|" + issued))
	return hex.EncodeToString(mac.Sum(nil))
}

// validSession returns the user of v, when v is a session cookie of one
// of the tokens issued less than ttl before now (and not after it, but
// for a minute of clock skew).
func (b *bearerAuth) validSession(v string, now time.Time, ttl time.Duration) (string, bool) {
	parts := strings.Split(v, ".")
	if len(parts) != 3 {
		return "", false
	}
	name, err := base64.RawURLEncoding.DecodeString(parts[0])
	if err != nil {
		return "", false
	}
	u, ok := b.byName[string(name)]
	if !ok {
		return "", false
	}
	issued, mac := parts[1], parts[2]
	if subtle.ConstantTimeCompare([]byte(mac), []byte(u.sessionMAC(issued))) != 1 {
		return "", false
	}
	sec, err := strconv.ParseInt(issued, 10, 64)
	if err != nil {
		return "", false
	}
	at := time.Unix(sec, 0)
	return u.name, now.Sub(at) < ttl && at.Before(now.Add(time.Minute))
}

// check returns the user whose token token is. Every token is compared,
// in constant time.
func (b *bearerAuth) check(token string) (*bearerUser, bool) {
	sum := sha256.Sum256([]byte(token))
	var found *bearerUser
	for i := range b.users {
		if subtle.ConstantTimeCompare(sum[:], b.users[i].sum[:]) == 1 {
			found = &b.users[i]
		}
	}
	return found, found != nil
}

func (b *bearerAuth) Authenticate(r *http.Request) (string, bool) {
	return b.authenticate(r, time.Now(), DefaultSessionTTL)
}

// authenticate is Authenticate at now, with session cookies good for ttl.
func (b *bearerAuth) authenticate(r *http.Request, now time.Time, ttl time.Duration) (string, bool) {
	if v := r.Header.Get("Authorization"); v != "" {
		scheme, token, _ := strings.Cut(v, " ")
		if !strings.EqualFold(scheme, "Bearer") {
			return "", false
		}
		u, ok := b.check(strings.TrimSpace(token))
		if !ok {
			return "", false
		}
		return u.name, true
	}
	if c, err := r.Cookie(cookieName); err == nil {
		return b.validSession(c.Value, now, ttl)
	}
	return "", false
}

// BasicAuth authenticates requests with HTTP basic credentials: the
// browser prompts for them (WWW-Authenticate), API clients send them
// (curl -u user:password). Comparisons take constant time. The password
// must be at least MinPasswordLength bytes long (New says so). Failed
// sign-ins are limited per client address (Config.SignInFailures).
// Actions are logged with the user name. Serve the console over TLS (or
// on a loopback address): basic credentials travel in clear.
func BasicAuth(user, password string) Authenticator {
	return &basicAuth{user: sha256.Sum256([]byte(user)), password: sha256.Sum256([]byte(password)), name: user,
		empty: user == "" || password == "", short: len(password) < MinPasswordLength}
}

type basicAuth struct {
	user, password [32]byte
	name           string
	empty, short   bool
}

func (b *basicAuth) validate() error {
	switch {
	case b.empty:
		return errors.New("BasicAuth needs a user name and a password")
	case b.short:
		return fmt.Errorf("BasicAuth: the password is shorter than %d bytes", MinPasswordLength)
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
//
// Wrong credentials count as a failed sign-in of the client
// (Config.SignInFailures).
func (h *handler) unauthenticated(w http.ResponseWriter, r *http.Request, api bool) {
	_, byFunc := h.cfg.Auth.(authFunc)
	if carriesCredentials(r) || byFunc {
		h.logRefusal(r, http.StatusUnauthorized, codeUnauthenticated, "not authenticated: the credentials are wrong (or expired)")
	}
	if carriesCredentials(r) {
		h.signIns.fail(clientOf(r), h.now())
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

// carriesCredentials reports whether r carries credentials: an
// Authorization header, or the session cookie.
func carriesCredentials(r *http.Request) bool {
	_, err := r.Cookie(cookieName)
	return r.Header.Get("Authorization") != "" || err == nil
}

// tooManyFailures refuses r, a sign-in or a request that carries
// credentials, when its client has used up its failed sign-ins
// (Config.SignInFailures): 429 with Retry-After, logged. Its credentials
// are not checked: a blocked client learns nothing of them. It reports
// whether it refused r.
func (h *handler) tooManyFailures(w http.ResponseWriter, r *http.Request, api bool) bool {
	if h.signIns == nil {
		return false
	}
	retry, blocked := h.signIns.blocked(clientOf(r), h.now())
	if !blocked {
		return false
	}
	secs := int64((retry + time.Second - 1) / time.Second)
	w.Header().Set("Retry-After", strconv.FormatInt(secs, 10))
	h.refuse(w, r, api, http.StatusTooManyRequests, codeTooManyFailures, fmt.Sprintf(
		"refused: too many failed sign-ins from your address (%d within %s); try again in %s", h.cfg.SignInFailures, h.cfg.SignInWindow, time.Duration(secs)*time.Second))
	return true
}

// sessionSignedIn reports whether r authenticates by a valid session
// cookie of BearerToken's login form alone. A client over its failed
// sign-ins keeps the sessions it signed in before: the cookie is signed
// (HMAC-SHA256, keyed by a token), which no number of guesses forges, so
// that a guesser behind the same address (a proxy's) does not sign every
// browser out.
func (h *handler) sessionSignedIn(r *http.Request) bool {
	b, ok := h.cfg.Auth.(*bearerAuth)
	if !ok || r.Header.Get("Authorization") != "" {
		return false
	}
	c, err := r.Cookie(cookieName)
	if err != nil {
		return false
	}
	_, ok = b.validSession(c.Value, h.now(), h.cfg.SessionTTL)
	return ok
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
		if h.tooManyFailures(w, r, false) {
			return true
		}
		r.Body = http.MaxBytesReader(w, r.Body, maxBody)
		next := h.safeNext(r.PostFormValue("next"))
		u, ok := b.check(r.PostFormValue("token"))
		if !ok {
			h.log.Warn("exactlyonce console: a sign-in with a wrong token", "remote_addr", r.RemoteAddr, "method", r.Method, "path", r.URL.Path,
				"status", http.StatusUnauthorized, "code", codeUnauthenticated)
			h.signIns.fail(clientOf(r), h.now())
			h.render(w, r, http.StatusUnauthorized, "login", "Sign in", loginData{Next: next, Failed: true})
			return true
		}
		http.SetCookie(w, &http.Cookie{Name: cookieName, Value: u.session(h.now()), Path: h.prefix + "/", HttpOnly: true,
			MaxAge: int(h.cfg.SessionTTL / time.Second), SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil || r.Header.Get("X-Forwarded-Proto") == "https"})
		h.log.Info("exactlyonce console: signed in", "user", u.name, "remote_addr", r.RemoteAddr)
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
