package console

import (
	"errors"
	"fmt"
	"html/template"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/ops"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// RedisStore is what the console needs of the Redis lease store
// (Config.Redis): the operators' operations on its records and parked
// messages, as the CLI needs them too. *redisstore.Store implements it. It
// is an interface so that a service that mounts the console over
// PostgreSQL alone imports no Redis client: this package does not import
// redisstore. The errors are inbox's (inbox.ErrNotParked,
// inbox.ErrNotFound, inbox.ErrChanged, inbox.ErrNotReplayable,
// inbox.ErrReplayInProgress, inbox.ErrTooBroad, inbox.ErrInvalidFilter):
// the console answers each with its code.
type RedisStore = ops.RedisStore

// Config configures the console's handler (New).
type Config struct {
	// DB is the PostgreSQL database of the inbox and outbox tables, as the
	// services' sqlschema.DB (the same names). Required unless Redis is
	// set; the outbox's figures, rows and relays need it.
	DB sqlschema.DB

	// Redis is the Redis lease store (a *redisstore.Store from
	// redisstore.New, with the services' Prefix and DoneTTL): its records
	// and parked messages are shown and acted on with ?store=redis.
	// Optional: nil (or a nil *redisstore.Store) is none.
	Redis RedisStore
	// RedisReplayPublisher is the publisher a replay from the Redis store
	// publishes through: one of the broker the consumers read from (a
	// rabbitmq.Publisher, say). Without it the Redis store's replays are
	// refused (503, "unavailable"); the caller owns and closes it.
	RedisReplayPublisher message.Publisher

	// Consumers are the PostgreSQL inbox's consumers the overview shows.
	// Empty (the default): those that have records or parked messages,
	// found by a loose index scan of the inbox (inbox.Store.Consumers),
	// at most 100.
	Consumers []string
	// RedisConsumers are the Redis store's consumers the overview shows
	// (the store keeps no list of them). The API and the pages take any
	// consumer with ?store=redis.
	RedisConsumers []string

	// Auth decides who may use the console: BearerToken (or
	// BearerTokens, a token per user), BasicAuth, or AuthFunc over the
	// identity your own middleware established. Required unless
	// InsecureNoAuth.
	Auth Authenticator
	// InsecureNoAuth serves everything to anyone who can reach the
	// handler, as user "anonymous": for a console on a developer's
	// loopback only. New logs a warning when it is set. It cannot be
	// combined with Auth.
	InsecureNoAuth bool
	// SessionTTL is how long the session cookie of BearerToken's login
	// form authenticates (it carries its issue time, signed; its Max-Age
	// says so too): the browser signs in again after it. Signing out
	// clears the browser's cookie; a copy of it stays good until it
	// expires. Defaults to DefaultSessionTTL (12 hours).
	SessionTTL time.Duration
	// SignInFailures is how many failed sign-ins a client address may
	// make within SignInWindow, with BearerToken, BearerTokens or
	// BasicAuth: a wrong token or password, in a header or in the login
	// form, or a forged or expired session cookie. After them, every
	// request of that address that carries credentials is refused (429,
	// code "too_many_failures", with Retry-After), the right ones too,
	// until SignInWindow has passed since its first failure; a success
	// does not reset the count. The address is the request's RemoteAddr
	// (an IPv6 address by its /64); no header is trusted. Behind a
	// reverse proxy every client has the proxy's address and shares one
	// count: set RemoteAddr from the proxy's header in a middleware of
	// yours in front of the console. At most 10,000 addresses are
	// remembered. Defaults to DefaultSignInFailures (10); negative: no
	// limit (when something in front limits sign-ins).
	SignInFailures int
	// SignInWindow is the window of SignInFailures. Defaults to
	// DefaultSignInWindow (15 minutes).
	SignInWindow time.Duration
	// ReadOnly refuses every action (replay, discard, requeue, forget):
	// the API answers 403 with the code "read_only" and the pages hide
	// the action forms.
	ReadOnly bool

	// Prefix is the path the handler is mounted at, without a trailing
	// slash: "/exactlyonce" serves the overview at /exactlyonce/ and the
	// API under /exactlyonce/api/v1/. Mount the handler at Prefix+"/" on
	// your mux, without http.StripPrefix. Empty (the default): the root.
	Prefix string

	// Logger receives the actions (at info: who, what, how many), the
	// refused requests (at warn: read-only, cross-origin, wrong
	// credentials, another Host, an empty bulk filter; with the user when
	// known, the address, the method, the path and the code) and the
	// errors (at error). Defaults to slog.Default().
	Logger *slog.Logger

	// StatsInterval is how often at most the overview's figures are
	// computed again: inbox.Store.Stats scans the inbox, too heavy for
	// every request on a large table, so the overview (and the figures of
	// the API's consumers and outbox) are served from the last
	// computation, which a request older than StatsInterval starts again
	// in the background; responses say when the figures were computed
	// ("as_of"). An action makes them stale: the next request computes
	// them again, but under a stream of actions at most every
	// min(StatsInterval, 5s). Defaults to 30s.
	StatsInterval time.Duration

	// MaxScan bounds the work of a search or count by a condition no index
	// serves: the reason's text (of parked messages and of outbox rows), a
	// tenant or a key without the consumer, and any search of the Redis
	// store (which has no index but a consumer's parked set). Such a
	// request is refused (422, "too_broad", saying what narrows it: a
	// consumer, a time range, a business id) when its other conditions
	// select more than MaxScan messages or rows, counted on the indexes
	// first; within the bound the database reads those only, in the
	// table's order. docs/console.md (Cost and limits) has the
	// measurements. Defaults to 10,000.
	MaxScan int
	// MaxCount bounds a count: the list pages' count, GET .../count, and
	// so a bulk action, which acts on what its count confirmed. More than
	// MaxCount matches are not counted: the API answers 422 "too_broad",
	// the pages say "more than MaxCount" and offer no bulk action. A count
	// reads the indexes, about a microsecond a match. Defaults to 100,000.
	MaxCount int
	// MaxConcurrentScans is how many requests may search or count by a
	// condition no index serves (see MaxScan) at once; one more is
	// answered 429 ("busy", with Retry-After) at once rather than queued
	// against the database. Defaults to 2.
	MaxConcurrentScans int

	// AllowedHosts are names (host, or host:port for that port only)
	// that requests may address the console by (their Host header),
	// besides the loopback's (127.0.0.0/8, ::1, localhost), which are
	// always allowed. With InsecureNoAuth every other name is refused
	// (421, "misdirected"): a page of another site whose name resolves
	// to the loopback (DNS rebinding) would be the console's own origin to
	// the browser, and read the payloads and post actions. With Auth, the
	// names are checked only when AllowedHosts is set. Behind a reverse
	// proxy that keeps the client's Host, list the proxy's name.
	AllowedHosts []string

	// TrustedOrigins are origins ("https://ops.example.com") whose
	// browsers may post actions although they are not the origin the
	// request was sent to: a reverse proxy that rewrites Host, say
	// (http.CrossOriginProtection.AddTrustedOrigin).
	TrustedOrigins []string
}

// Defaults.
const (
	defaultStatsInterval = 30 * time.Second
	// defaultMaxScan, defaultMaxCount and defaultMaxConcurrentScans are
	// Config.MaxScan's, MaxCount's and MaxConcurrentScans's defaults.
	defaultMaxScan            = 10_000
	defaultMaxCount           = 100_000
	defaultMaxConcurrentScans = 2
	// overviewConsumers is the most consumers the overview shows when
	// Config.Consumers is empty.
	overviewConsumers = 100
	// maxBody bounds a request's body (a bulk action's filter, a form).
	maxBody = 1 << 20
	// readTimeout bounds the database work of a read; actionTimeout that
	// of an action (a bulk replay works in batches).
	readTimeout   = 15 * time.Second
	actionTimeout = 5 * time.Minute
)

// Stores, as the API names them.
const (
	storePostgres = ops.StorePostgres
	storeRedis    = ops.StoreRedis
)

var prefixPattern = regexp.MustCompile(`^(/[A-Za-z0-9._~-]+)*$`)

// handler is the console: the API and the pages behind one authentication
// decision.
type handler struct {
	cfg Config
	pg  *inbox.Store // nil without Config.DB
	// pgOps and redis are the stores as the operator layer acts on them
	// (nil when not configured); rows are the outbox's rows.
	pgOps    ops.Store
	redis    ops.Store
	rows     ops.Rows
	log      *slog.Logger
	cop      *http.CrossOriginProtection
	mux      *http.ServeMux // the routes, with the prefix
	apiMux   *http.ServeMux // the API's routes, for 405s
	stats    *statsCache
	pages    map[string]*template.Template
	stores   []string
	prefix   string
	apiRoot  string // prefix + "/api/"
	insecure bool
	// hosts are Config.AllowedHosts, parsed; checkHost says whether the
	// Host of a request is checked (InsecureNoAuth, or AllowedHosts set).
	hosts     []allowedHost
	checkHost bool
	// signIns counts the failed sign-ins per client (nil: no limit, or
	// an authenticator it does not apply to).
	signIns *signInLimit
	// now is the clock of the session cookies and of signIns (a test's
	// to move).
	now func() time.Time
	// scans holds a token per search or count by a condition no index
	// serves under way (Config.MaxConcurrentScans).
	scans chan struct{}
	// scanning, when set (by a test), is called by such a request while
	// it holds its token, before it reads.
	scanning func()
}

// allowedHost is an entry of Config.AllowedHosts: a name, and a port
// ("" for any).
type allowedHost struct{ name, port string }

// parseAllowedHost reads an entry of Config.AllowedHosts.
func parseAllowedHost(s string) (allowedHost, error) {
	s = strings.ToLower(strings.TrimSpace(s))
	name, port := s, ""
	if n, p, err := net.SplitHostPort(s); err == nil {
		name, port = n, p
		if _, err := strconv.ParseUint(p, 10, 16); err != nil {
			return allowedHost{}, fmt.Errorf("%q: the port is not a number", s)
		}
	}
	name = strings.TrimSuffix(strings.TrimPrefix(name, "["), "]")
	if name == "" || strings.ContainsAny(name, "/:@ \t?#%") && net.ParseIP(name) == nil {
		return allowedHost{}, fmt.Errorf("%q: want a host name or address, or host:port (ops.example.com, ops.example.com:8089)", s)
	}
	return allowedHost{name: name, port: port}, nil
}

// hostAllowed reports whether host (a request's Host) names the console:
// a loopback address, localhost, or one of Config.AllowedHosts.
func (h *handler) hostAllowed(host string) bool {
	host = strings.ToLower(host)
	name, port := host, ""
	if n, p, err := net.SplitHostPort(host); err == nil {
		name, port = n, p
	}
	name = strings.TrimSuffix(strings.TrimPrefix(name, "["), "]")
	if name == "localhost" {
		return true
	}
	if ip := net.ParseIP(name); ip != nil && ip.IsLoopback() {
		return true
	}
	for _, a := range h.hosts {
		if a.name == name && (a.port == "" || a.port == port) {
			return true
		}
	}
	return false
}

// nilStore reports whether s is no store: nil, or a nil pointer in the
// interface (a nil *redisstore.Store), which New takes as none.
func nilStore(s RedisStore) bool {
	if s == nil {
		return true
	}
	v := reflect.ValueOf(s)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// New returns the console's http.Handler: the admin API under
// Prefix+"/api/v1/" and the web console's pages under Prefix+"/". Mount
// it on your mux at Prefix+"/":
//
//	h, err := console.New(console.Config{DB: db, Prefix: "/exactlyonce", Auth: console.BearerToken(token)})
//	mux.Handle("/exactlyonce/", h)
//
// Every request but the style sheet, the script and the login form is
// authenticated first (Config.Auth); an action (POST, DELETE) must also
// come from the console's own origin (http.CrossOriginProtection) and is
// refused in ReadOnly mode. New does not touch the database.
func New(cfg Config) (http.Handler, error) {
	if nilStore(cfg.Redis) {
		cfg.Redis = nil
	}
	if cfg.DB.Conn == nil && cfg.Redis == nil {
		return nil, errors.New("console: New: Config.DB.Conn or Config.Redis is required")
	}
	if cfg.DB.Conn == nil && len(cfg.Consumers) > 0 {
		return nil, errors.New("console: New: Config.Consumers is set without Config.DB (Redis consumers go in Config.RedisConsumers)")
	}
	if cfg.Redis == nil && len(cfg.RedisConsumers) > 0 {
		return nil, errors.New("console: New: Config.RedisConsumers is set without Config.Redis")
	}
	switch {
	case cfg.Auth == nil && !cfg.InsecureNoAuth:
		return nil, errors.New("console: New: Config.Auth is required (or Config.InsecureNoAuth)")
	case cfg.Auth != nil && cfg.InsecureNoAuth:
		return nil, errors.New("console: New: Config.Auth and Config.InsecureNoAuth are both set: choose one")
	}
	if v, ok := cfg.Auth.(interface{ validate() error }); ok {
		if err := v.validate(); err != nil {
			return nil, fmt.Errorf("console: New: Config.Auth: %w", err)
		}
	}
	prefix := strings.TrimSuffix(cfg.Prefix, "/")
	if !prefixPattern.MatchString(prefix) {
		return nil, fmt.Errorf("console: New: Config.Prefix %q: a path such as /exactlyonce (letters, digits and . _ ~ - between slashes)", cfg.Prefix)
	}
	if cfg.StatsInterval < 0 {
		return nil, fmt.Errorf("console: New: Config.StatsInterval is %s: it must not be negative", cfg.StatsInterval)
	}
	if cfg.StatsInterval == 0 {
		cfg.StatsInterval = defaultStatsInterval
	}
	if cfg.SessionTTL < 0 {
		return nil, fmt.Errorf("console: New: Config.SessionTTL is %s: it must not be negative", cfg.SessionTTL)
	}
	if cfg.SessionTTL == 0 {
		cfg.SessionTTL = DefaultSessionTTL
	}
	if cfg.SignInWindow < 0 {
		return nil, fmt.Errorf("console: New: Config.SignInWindow is %s: it must not be negative", cfg.SignInWindow)
	}
	if cfg.SignInWindow == 0 {
		cfg.SignInWindow = DefaultSignInWindow
	}
	if cfg.SignInFailures == 0 {
		cfg.SignInFailures = DefaultSignInFailures
	}
	for _, b := range []struct {
		name string
		v    *int
		def  int
	}{{"MaxScan", &cfg.MaxScan, defaultMaxScan}, {"MaxCount", &cfg.MaxCount, defaultMaxCount},
		{"MaxConcurrentScans", &cfg.MaxConcurrentScans, defaultMaxConcurrentScans}} {
		if *b.v < 0 {
			return nil, fmt.Errorf("console: New: Config.%s is %d: it must not be negative (0: %d)", b.name, *b.v, b.def)
		}
		if *b.v == 0 {
			*b.v = b.def
		}
	}
	for _, c := range append(append([]string(nil), cfg.Consumers...), cfg.RedisConsumers...) {
		if c == "" {
			return nil, errors.New("console: New: an empty consumer name in Config.Consumers or Config.RedisConsumers")
		}
	}
	h := &handler{cfg: cfg, log: cfg.Logger, cop: http.NewCrossOriginProtection(), prefix: prefix, apiRoot: prefix + "/api/", now: time.Now,
		scans: make(chan struct{}, cfg.MaxConcurrentScans)}
	if h.log == nil {
		h.log = slog.Default()
	}
	for _, a := range cfg.AllowedHosts {
		ah, err := parseAllowedHost(a)
		if err != nil {
			return nil, fmt.Errorf("console: New: Config.AllowedHosts: %w", err)
		}
		h.hosts = append(h.hosts, ah)
	}
	h.checkHost = cfg.InsecureNoAuth || len(h.hosts) > 0
	switch cfg.Auth.(type) {
	case *bearerAuth, *basicAuth:
		if cfg.SignInFailures > 0 {
			h.signIns = newSignInLimit(cfg.SignInFailures, cfg.SignInWindow)
		}
	}
	for _, o := range cfg.TrustedOrigins {
		if err := h.cop.AddTrustedOrigin(o); err != nil {
			return nil, fmt.Errorf("console: New: Config.TrustedOrigins: %w", err)
		}
	}
	if cfg.DB.Conn != nil {
		cfg.DB = cfg.DB.WithDefaults()
		if err := cfg.DB.Validate(); err != nil {
			return nil, fmt.Errorf("console: New: Config.DB: %w", err)
		}
		s, err := inbox.NewStore(cfg.DB)
		if err != nil {
			return nil, fmt.Errorf("console: New: %w", err)
		}
		rows, err := ops.NewRows(cfg.DB)
		if err != nil {
			return nil, fmt.Errorf("console: New: %w", err)
		}
		h.cfg.DB, h.pg, h.pgOps, h.rows = cfg.DB, s, ops.Postgres(s, cfg.DB), rows
		h.stores = append(h.stores, storePostgres)
	}
	if cfg.Redis != nil {
		h.stores = append(h.stores, storeRedis)
		pub := cfg.RedisReplayPublisher
		h.redis = ops.Redis(cfg.Redis, func() (message.Publisher, error) {
			if pub == nil {
				return nil, unavailable("a replay from the Redis store publishes through Config.RedisReplayPublisher, which is not set")
			}
			return pub, nil
		})
	}
	h.stats = newStatsCache(h, cfg.StatsInterval)
	pages, err := parsePages()
	if err != nil {
		return nil, fmt.Errorf("console: New: %w", err)
	}
	h.pages = pages
	h.routes()
	if cfg.InsecureNoAuth {
		h.insecure = true
		h.log.Warn("exactlyonce console: INSECURE: Config.InsecureNoAuth is set: anyone who can reach this handler can read parked messages and replay or discard them; use it on a loopback address only",
			"prefix", prefix+"/", "read_only", cfg.ReadOnly)
	}
	return h, nil
}

// ServeHTTP makes the authentication decision, then routes.
func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	hdr := w.Header()
	hdr.Set("X-Content-Type-Options", "nosniff")
	hdr.Set("Referrer-Policy", "same-origin")
	hdr.Set("X-Frame-Options", "DENY")
	hdr.Set("Content-Security-Policy", "default-src 'none'; style-src 'self'; script-src 'self'; connect-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
	hdr.Set("Cache-Control", "no-store")
	api := strings.HasPrefix(r.URL.Path, h.apiRoot)
	if h.checkHost && !h.hostAllowed(r.Host) {
		h.refuse(w, r, api, http.StatusMisdirectedRequest, codeMisdirected,
			"refused: this console does not answer to the name "+strconv.Quote(r.Host)+" (the request's Host); it answers to the loopback's names"+
				" (127.0.0.1, [::1], localhost) and to Config.AllowedHosts (exactlyonce ui --allowed-host)")
		return
	}
	if h.prefix != "" && r.URL.Path == h.prefix {
		http.Redirect(w, r, h.prefix+"/", http.StatusMovedPermanently)
		return
	}
	if !api && h.public(w, r) {
		return
	}
	if carriesCredentials(r) && !h.sessionSignedIn(r) && h.tooManyFailures(w, r, api) {
		return
	}
	user, ok := h.authenticate(r)
	if !ok {
		h.unauthenticated(w, r, api)
		return
	}
	r = r.WithContext(withUser(r.Context(), user))
	if !safeMethod(r.Method) {
		if err := h.cop.Check(r); err != nil {
			h.refuse(w, r, api, http.StatusForbidden, codeCrossOrigin,
				"refused: this action comes from another site (cross-origin request); open the console itself to act")
			return
		}
		if h.cfg.ReadOnly && !h.sessionPath(r.URL.Path) {
			h.refuse(w, r, api, http.StatusForbidden, codeReadOnly, "refused: the console is read-only; no action is allowed")
			return
		}
		if api && !jsonBody(r) {
			h.refuse(w, r, api, http.StatusUnsupportedMediaType, codeUnsupportedMediaType,
				"refused: an action's body is JSON, with Content-Type: application/json (or no body and no Content-Type)")
			return
		}
	}
	r.Body = http.MaxBytesReader(w, r.Body, maxBody)
	h.mux.ServeHTTP(w, r)
}

// jsonBody reports whether r's body is said to be JSON, or r has neither
// a body nor a Content-Type. A page of another site can post a form or
// text/plain without asking; JSON needs a CORS preflight, which the
// console never grants: a second defence behind the origin check.
func jsonBody(r *http.Request) bool {
	ct := r.Header.Get("Content-Type")
	if ct == "" {
		return r.ContentLength == 0
	}
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && mt == "application/json"
}

func safeMethod(m string) bool {
	return m == http.MethodGet || m == http.MethodHead || m == http.MethodOptions
}
