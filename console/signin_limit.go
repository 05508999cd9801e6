package console

import (
	"net"
	"net/http"
	"net/netip"
	"sync"
	"time"
)

// Defaults of the limit on failed sign-ins (Config.SignInFailures,
// Config.SignInWindow).
const (
	DefaultSignInFailures = 10
	DefaultSignInWindow   = 15 * time.Minute
)

// maxSignInClients bounds the client addresses whose failed sign-ins are
// remembered: past it, the records whose window has passed are dropped,
// then the oldest.
const maxSignInClients = 10_000

// signInLimit counts the failed sign-ins of each client address: after
// max failures within window (from the client's first failure), its
// credentials are not checked until the window has passed. A failure is
// forgotten only when its window passes: a success does not reset the
// count, so that a client holding one credential (one of BearerTokens')
// cannot interleave successes to buy guesses of another, and a request
// that succeeds only reads the record. It belongs to one handler.
type signInLimit struct {
	max     int
	window  time.Duration
	clients int // the most records kept (maxSignInClients)

	mu      sync.Mutex
	records map[string]signInRecord
}

// signInRecord is a client's failures in its current window.
type signInRecord struct {
	first time.Time // the window's first failure
	n     int
}

func newSignInLimit(max int, window time.Duration) *signInLimit {
	return &signInLimit{max: max, window: window, clients: maxSignInClients, records: map[string]signInRecord{}}
}

// blocked reports whether client has used up its failures: then retry is
// how long until its window has passed.
func (l *signInLimit) blocked(client string, now time.Time) (retry time.Duration, blocked bool) {
	if l == nil {
		return 0, false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	rec, ok := l.records[client]
	if !ok {
		return 0, false
	}
	end := rec.first.Add(l.window)
	if !now.Before(end) {
		delete(l.records, client)
		return 0, false
	}
	return end.Sub(now), rec.n >= l.max
}

// fail records a failed sign-in of client at now.
func (l *signInLimit) fail(client string, now time.Time) {
	if l == nil {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	rec, ok := l.records[client]
	if !ok || !now.Before(rec.first.Add(l.window)) {
		if !ok && len(l.records) >= l.clients {
			l.prune(now)
		}
		rec = signInRecord{first: now}
	}
	rec.n++
	l.records[client] = rec
}

// prune makes room for a record: it drops those whose window has passed,
// and, when none has, the oldest (an attack from more addresses than
// maxSignInClients, which gets max guesses per address anyway). l.mu is
// held.
func (l *signInLimit) prune(now time.Time) {
	var oldest string
	var oldestAt time.Time
	for c, rec := range l.records {
		if !now.Before(rec.first.Add(l.window)) {
			delete(l.records, c)
			continue
		}
		if oldest == "" || rec.first.Before(oldestAt) {
			oldest, oldestAt = c, rec.first
		}
	}
	if len(l.records) >= l.clients {
		delete(l.records, oldest)
	}
}

// clientOf is the client a request's failed sign-ins are counted for: its
// remote address (http.Request.RemoteAddr, without the port), an IPv6
// address by its /64 (one host commonly holds a whole /64). No header is
// trusted (anyone can send X-Forwarded-For): behind a reverse proxy every
// client has the proxy's address, unless a middleware of the service that
// trusts the proxy's header sets RemoteAddr first.
func clientOf(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		host = r.RemoteAddr
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return host
	}
	ip = ip.Unmap().WithZone("")
	if ip.Is6() {
		if p, err := ip.Prefix(64); err == nil {
			return p.String()
		}
	}
	return ip.String()
}
