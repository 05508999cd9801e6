package testenv

import (
	"errors"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// Proxy is a minimal TCP proxy for fault tests. It listens on 127.0.0.1 on
// a free port and forwards every connection to a target address (PostgreSQL,
// RabbitMQ, ...). Refuse makes the target look down: it closes every live
// connection and closes each new one as soon as it is accepted, so clients
// get an immediate EOF or reset instead of a hang. Allow makes it forward
// again. The listening address never changes, so clients configured with it
// (a pgx pool, a *sql.DB) reconnect on their own once it allows.
//
// A Proxy is safe for concurrent use. Close stops it and waits for all its
// goroutines, so it leaves none behind.
type Proxy struct {
	ln     net.Listener
	target string

	dropping atomic.Bool // Blackhole: bytes of live connections vanish

	mu       sync.Mutex
	refusing bool
	closed   bool
	conns    map[net.Conn]struct{}
	accepted int64
	refused  int64

	wg sync.WaitGroup
}

// NewProxy starts a Proxy to target (host:port) and closes it at cleanup.
func NewProxy(t testing.TB, target string) *Proxy {
	t.Helper()
	p, err := StartProxy(target)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// StartProxy starts a Proxy to target (host:port), listening on
// 127.0.0.1:0. The caller must Close it.
func StartProxy(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	p.wg.Add(1)
	go p.acceptLoop()
	return p, nil
}

// Addr is the proxy's listening address, host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Target is the address the proxy forwards to.
func (p *Proxy) Target() string { return p.target }

// RewriteURL returns rawURL (postgres://..., amqp://...) with its host and
// port replaced by the proxy's address. It panics on an unparsable URL,
// which is a bug in the test.
func (p *Proxy) RewriteURL(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		panic("testenv: Proxy.RewriteURL: " + err.Error())
	}
	u.Host = p.Addr()
	return u.String()
}

// Refuse closes every live connection and makes the proxy close new ones at
// once, until Allow. It returns after the live connections were closed.
func (p *Proxy) Refuse() {
	p.mu.Lock()
	p.refusing = true
	conns := make([]net.Conn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
	}
	p.mu.Unlock()
	for _, c := range conns {
		_ = c.Close()
	}
}

// Blackhole makes the live connections silent without closing them: what
// either side sends is read and dropped, as in a network partition that
// leaves both ends' TCP connections open (no EOF, no reset). Allow ends it.
func (p *Proxy) Blackhole() { p.dropping.Store(true) }

// Allow makes the proxy forward new connections again (and ends a
// Blackhole).
func (p *Proxy) Allow() {
	p.dropping.Store(false)
	p.mu.Lock()
	p.refusing = false
	p.mu.Unlock()
}

// Refusing reports whether the proxy currently refuses connections.
func (p *Proxy) Refusing() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.refusing
}

// ProxyStats counts the client connections a Proxy has seen.
type ProxyStats struct {
	// Accepted is the number of connections forwarded to the target.
	Accepted int64
	// Refused is the number of connections closed at once while refusing
	// (or because the target could not be reached).
	Refused int64
	// Live is the number of connections being forwarded now.
	Live int
}

// Stats returns the proxy's counters.
func (p *Proxy) Stats() ProxyStats {
	p.mu.Lock()
	defer p.mu.Unlock()
	// Each forwarded connection is tracked as two conns (client, target).
	return ProxyStats{Accepted: p.accepted, Refused: p.refused, Live: len(p.conns) / 2}
}

// Close stops listening, closes every connection and waits for the proxy's
// goroutines to end. Calling it again is a no-op.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.mu.Unlock()
	err := p.ln.Close()
	p.Refuse()
	p.wg.Wait()
	return err
}

func (p *Proxy) acceptLoop() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			continue
		}
		p.mu.Lock()
		refuse := p.refusing || p.closed
		if refuse {
			p.refused++
		}
		p.mu.Unlock()
		if refuse {
			_ = c.Close()
			continue
		}
		p.wg.Add(1)
		go p.forward(c)
	}
}

func (p *Proxy) forward(client net.Conn) {
	defer p.wg.Done()
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		p.mu.Lock()
		p.refused++
		p.mu.Unlock()
		_ = client.Close()
		return
	}
	p.mu.Lock()
	if p.refusing || p.closed {
		// Refuse ran while dialing: this connection must not live.
		p.refused++
		p.mu.Unlock()
		_ = client.Close()
		_ = server.Close()
		return
	}
	p.accepted++
	p.conns[client] = struct{}{}
	p.conns[server] = struct{}{}
	p.mu.Unlock()

	var wg sync.WaitGroup
	pipe := func(dst, src net.Conn) {
		defer wg.Done()
		buf := make([]byte, 32<<10)
		for {
			n, err := src.Read(buf)
			if n > 0 && !p.dropping.Load() {
				if _, werr := dst.Write(buf[:n]); werr != nil {
					break
				}
			}
			if err != nil {
				break
			}
		}
		// One direction ended (EOF, or Refuse closed a side): end both.
		_ = dst.Close()
		_ = src.Close()
	}
	wg.Add(2)
	go pipe(server, client)
	go pipe(client, server)
	wg.Wait()

	p.mu.Lock()
	delete(p.conns, client)
	delete(p.conns, server)
	p.mu.Unlock()
}
