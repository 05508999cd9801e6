package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

const uiToken = "ui-test-token-0123456789abcdef"

// uiProc is a running `exactlyonce ui`.
type uiProc struct {
	base           string       // http(s)://127.0.0.1:port + prefix
	client         *http.Client // follows no redirect; trusts the test's certificate over TLS
	stdout, stderr *syncBuffer
	cmd            *exec.Cmd
	done           chan struct{} // closed when the process exited
	err            error         // its exit error, once done is closed
}

// startUI starts `exactlyonce ui --listen 127.0.0.1:0 args...` with env
// (on top of an environment cleared of what the command reads) and waits
// for the address it prints (on 127.0.0.1 when args listen on every
// interface).
func startUI(t *testing.T, env []string, args ...string) *uiProc {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	cmd := exec.CommandContext(ctx, binary, append([]string{"ui", "--listen", "127.0.0.1:0"}, args...)...)
	var clean []string
	for _, kv := range cleanEnv() {
		if name, _, _ := strings.Cut(kv, "="); name != envUIToken && name != envUIPassword && name != envRedisURL {
			clean = append(clean, kv)
		}
	}
	clean = append(clean, env...)
	cmd.Env = clean
	p := &uiProc{stdout: &syncBuffer{}, stderr: &syncBuffer{}, cmd: cmd, done: make(chan struct{}),
		client: &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}}
	cmd.Stdout, cmd.Stderr = p.stdout, p.stderr
	require.NoError(t, cmd.Start())
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			_ = cmd.Process.Kill()
			<-p.done
		}
	})
	addr := regexp.MustCompile(`Serving the exactlyonce console on (https?://)(127\.0\.0\.1|0\.0\.0\.0|\[::\])(:\d+\S*)/ `)
	require.Eventually(t, func() bool {
		m := addr.FindStringSubmatch(p.stdout.String())
		if m != nil {
			p.base = m[1] + "127.0.0.1" + m[3]
		}
		select {
		case <-p.done:
			return true
		default:
		}
		return m != nil
	}, 30*time.Second, 20*time.Millisecond, "the address\nstdout:\n%s\nstderr:\n%s", p.stdout, p.stderr)
	require.NotEmpty(t, p.base, "it stopped before serving\nstdout:\n%s\nstderr:\n%s", p.stdout, p.stderr)
	return p
}

// stop sends SIGINT and asserts exit status 0.
func (p *uiProc) stop(t *testing.T) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Signal(syscall.SIGINT))
	select {
	case <-p.done:
		require.NoError(t, p.err, "exit status 0 after SIGINT\nstdout:\n%s\nstderr:\n%s", p.stdout, p.stderr)
	case <-time.After(20 * time.Second):
		require.FailNow(t, "the console did not stop within 20s of SIGINT", "stderr:\n%s", p.stderr)
	}
	require.Contains(t, p.stderr.String(), "exactlyonce console stopped")
}

func (p *uiProc) do(t *testing.T, method, path, auth string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, p.base+path, nil)
	require.NoError(t, err)
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	res, err := p.client.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	b, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(b)
}

// `exactlyonce ui` serves the console: the overview's API with the
// token, 401 without it, the pages behind a login form; SIGINT stops it.
func TestUIServes(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, testUIServes)
}

func testUIServes(t *testing.T, b *testenv.Bundle) {
	db := b.DB.WithDefaults()
	insertInbox(t, db,
		inboxRow{consumer: "charge-order", key: "o-1", status: "done", attempts: 1, firstSeenAgo: time.Hour, finishedAgo: time.Hour},
		inboxRow{consumer: "charge-order", key: "o-2", status: "parked", attempts: 1, firstSeenAgo: time.Hour, finishedAgo: time.Hour, lastError: "card declined"},
	)
	insertParkedMessage(t, db, "charge-order", "o-2")
	p := startUI(t, append(engineEnv(b), envUIToken+"="+uiToken))
	require.Contains(t, p.stdout.String(), "inbox "+db.Schema+".watermill_inbox")
	require.Contains(t, p.stdout.String(), "Ctrl-C stops it.")
	require.NotContains(t, p.stdout.String(), uiToken, "a given token is not printed")

	code, body := p.do(t, "GET", "/api/v1/overview", "Bearer "+uiToken)
	require.Equal(t, http.StatusOK, code, body)
	var doc struct {
		AsOf      *string `json:"as_of"`
		Consumers []struct {
			Consumer string `json:"consumer"`
			Done     int64  `json:"done"`
			Parked   int64  `json:"parked"`
		} `json:"consumers"`
		Outbox *struct {
			Pending int64 `json:"pending"`
		} `json:"outbox"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &doc))
	require.NotNil(t, doc.AsOf)
	require.Len(t, doc.Consumers, 1)
	require.Equal(t, "charge-order", doc.Consumers[0].Consumer)
	require.EqualValues(t, 1, doc.Consumers[0].Done)
	require.EqualValues(t, 1, doc.Consumers[0].Parked)
	require.NotNil(t, doc.Outbox)

	code, body = p.do(t, "GET", "/api/v1/overview", "")
	require.Equal(t, http.StatusUnauthorized, code)
	require.Contains(t, body, `"code": "unauthenticated"`)
	code, _ = p.do(t, "GET", "/api/v1/overview", "Bearer not-the-token-0123456789")
	require.Equal(t, http.StatusUnauthorized, code)
	code, body = p.do(t, "GET", "/", "")
	require.Equal(t, http.StatusUnauthorized, code)
	require.Contains(t, body, `<form id="login"`)
	code, body = p.do(t, "GET", "/parked/charge-order/o-2", "Bearer "+uiToken)
	require.Equal(t, http.StatusOK, code)
	require.Contains(t, body, `<pre id="payload"`)
	p.stop(t)
}

// Refused at start, exit status 2: no authentication off loopback, a
// short token, two kinds of credentials, no store.
func TestUIRefuses(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	db := testenv.Schema(t)
	env := dbEnv(db.Schema)
	for _, c := range []struct {
		args []string
		env  []string
		want string
	}{
		{[]string{"ui", "--insecure-no-auth", "--listen", "0.0.0.0:0"}, env, "refused unless --listen is a loopback address"},
		{[]string{"ui", "--insecure-no-auth", "--listen", ":8089"}, env, "refused unless --listen is a loopback address"},
		{[]string{"ui", "--insecure-no-auth", "--token", uiToken}, env, "choose one"},
		{[]string{"ui", "--token", "short"}, env, "shorter than 16 bytes"},
		{[]string{"ui", "--token", uiToken, "--basic-user", "u", "--basic-password", "p"}, env, "choose one"},
		{[]string{"ui", "--basic-user", "u"}, env, "--basic-password"},
		{[]string{"ui", "--basic-user", "u", "--basic-password", "short"}, env, "the password is shorter than 16 bytes"},
		{[]string{"ui", "--token", uiToken}, nil, "no database"},
		{[]string{"ui", "--token", uiToken, "--prefix", "eo/"}, env, "--prefix"},
		{[]string{"ui", "--token", uiToken, "--redis-consumer", "x"}, env, "--redis-consumer without --redis-url"},
		{[]string{"ui", "--token", uiToken, "--stats-interval", "0s"}, env, "--stats-interval"},
		{[]string{"ui", "--token", uiToken, "--listen", "0.0.0.0:0"}, env, "--listen 0.0.0.0:0 is not a loopback address"},
		{[]string{"ui", "--token", uiToken, "--listen", ":8089"}, env, "--listen :8089 is not a loopback address"},
		{[]string{"ui", "--token", uiToken, "--tls-cert", "cert.pem"}, env, "--tls-cert and --tls-key go together"},
		{[]string{"ui", "--token", uiToken, "--tls-key", "key.pem"}, env, "--tls-cert and --tls-key go together"},
		{[]string{"ui", "--token", uiToken, "--tls-cert", "/nonexistent/cert.pem", "--tls-key", "/nonexistent/key.pem"}, env, "--tls-cert, --tls-key: open /nonexistent/cert.pem"},
		{[]string{"ui", "--token", uiToken, "--tls-cert", "c.pem", "--tls-key", "k.pem", "--tls-terminated-in-front"}, env, "drop --tls-terminated-in-front"},
	} {
		requireExit(t, cli(t, c.env, c.args...), exitUsage, c.want)
	}
}

// Without credentials given, a token is made up and printed; --prefix
// serves under a path (the root redirects there); --read-only refuses
// actions; basic credentials from the environment; --insecure-no-auth
// on loopback serves anyone, with a warning.
func TestUIOptions(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	db := testenv.Schema(t)

	p := startUI(t, dbEnv(db.Schema), "--prefix", "/eo", "--read-only")
	// The token line follows the line startUI waited for: wait for it too.
	tokenLine := regexp.MustCompile(`Sign in with this token \(made up for this run; set \$EXACTLYONCE_UI_TOKEN to choose one\): ([0-9a-f]{48})\n`)
	var m []string
	require.Eventually(t, func() bool {
		m = tokenLine.FindStringSubmatch(p.stdout.String())
		return m != nil
	}, 10*time.Second, 10*time.Millisecond, "%s", p.stdout)
	require.True(t, strings.HasSuffix(p.base, "/eo"), p.base)
	require.Contains(t, p.stdout.String(), ", read-only.")
	code, _ := p.do(t, "GET", "/api/v1/relays", "Bearer "+m[1])
	require.Equal(t, http.StatusOK, code)
	code, body := p.do(t, "POST", "/api/v1/outbox/rows/1/requeue", "Bearer "+m[1])
	require.Equal(t, http.StatusForbidden, code)
	require.Contains(t, body, `"code": "read_only"`)
	root := strings.TrimSuffix(p.base, "/eo")
	res, err := (&http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}).Get(root + "/")
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusSeeOther, res.StatusCode)
	require.Equal(t, "/eo/", res.Header.Get("Location"))
	p.stop(t)

	p = startUI(t, append(dbEnv(db.Schema), envUIPassword+"=ops-long-passphrase"), "--basic-user", "ops")
	req, _ := http.NewRequest("GET", p.base+"/api/v1/overview", nil)
	req.SetBasicAuth("ops", "ops-long-passphrase")
	res, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)
	code, _ = p.do(t, "GET", "/api/v1/overview", "")
	require.Equal(t, http.StatusUnauthorized, code)
	p.stop(t)

	p = startUI(t, dbEnv(db.Schema), "--insecure-no-auth")
	require.Contains(t, p.stdout.String(), "WARNING: no authentication")
	require.Contains(t, p.stderr.String(), "INSECURE")
	code, _ = p.do(t, "GET", "/api/v1/overview", "")
	require.Equal(t, http.StatusOK, code)
	p.stop(t)
}

// The Redis lease store alone: its consumers' parked figures.
func TestUIRedis(t *testing.T) {
	t.Parallel()
	rdb := testenv.Redis(t)
	prefix := testenv.RedisPrefix(t, rdb)
	p := startUI(t, []string{envRedisURL + "=" + testenv.RedisURL(), envUIToken + "=" + uiToken},
		"--redis-url", "", "--redis-prefix", prefix, "--redis-consumer", "send-sms")
	require.Contains(t, p.stdout.String(), "the Redis lease store")
	code, body := p.do(t, "GET", "/api/v1/overview", "Bearer "+uiToken)
	require.Equal(t, http.StatusOK, code, body)
	require.Contains(t, body, `"store": "redis"`)
	require.Contains(t, body, `"consumer": "send-sms"`)
	code, body = p.do(t, "GET", "/api/v1/outbox", "Bearer "+uiToken)
	require.Equal(t, http.StatusServiceUnavailable, code, body)
	p.stop(t)
}

// `exactlyonce ui` on a loopback address answers only to the loopback's
// names and to --allowed-host, with a token too: a page of another site
// whose name resolves to the loopback (DNS rebinding) is refused.
func TestUIRefusesOtherHosts(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	db := testenv.Schema(t)
	get := func(p *uiProc, host, auth string) (int, string) {
		t.Helper()
		req, err := http.NewRequest("GET", p.base+"/api/v1/relays", nil)
		require.NoError(t, err)
		req.Host = host
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer res.Body.Close()
		b, err := io.ReadAll(res.Body)
		require.NoError(t, err)
		return res.StatusCode, string(b)
	}
	p := startUI(t, append(dbEnv(db.Schema), envUIToken+"="+uiToken), "--allowed-host", "ops.example")
	port := p.base[strings.LastIndex(p.base, ":")+1:]
	code, body := get(p, "attacker.example:"+port, "Bearer "+uiToken)
	require.Equal(t, http.StatusMisdirectedRequest, code, body)
	require.Contains(t, body, `"code": "misdirected"`)
	for _, host := range []string{"127.0.0.1:" + port, "localhost:" + port, "ops.example"} {
		code, body = get(p, host, "Bearer "+uiToken)
		require.Equal(t, http.StatusOK, code, "%s: %s", host, body)
	}
	p.stop(t)

	p = startUI(t, dbEnv(db.Schema), "--insecure-no-auth")
	code, _ = get(p, "attacker.example", "")
	require.Equal(t, http.StatusMisdirectedRequest, code)
	code, _ = get(p, "localhost", "")
	require.Equal(t, http.StatusOK, code)
	p.stop(t)
}

// Off the loopback, `exactlyonce ui` refuses to serve plain HTTP unless
// told that TLS is terminated in front; the refusal says what to do. The
// loopback's addresses stay plain HTTP.
func TestUIRefusesPlainHTTPOffLoopback(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	db := testenv.Schema(t)
	r := cli(t, dbEnv(db.Schema), "ui", "--token", uiToken, "--listen", "0.0.0.0:8089")
	requireExit(t, r, exitUsage, "not a loopback address")
	for _, want := range []string{"would cross the network in clear", "--tls-cert FILE --tls-key FILE", "--tls-terminated-in-front", "--listen 127.0.0.1:8089"} {
		require.Contains(t, r.stderr, want)
	}
	for addr, loopback := range map[string]bool{
		"127.0.0.1:8089": true, "127.1.2.3:8089": true, "[::1]:8089": true, "localhost:8089": true,
		":8089": false, "0.0.0.0:8089": false, "[::]:8089": false, "10.0.0.7:8089": false, "ops.example.com:8089": false,
	} {
		_, err := uiTLS(uiOptions{listen: addr})
		require.Equal(t, loopback, err == nil, "%s: %v", addr, err)
		_, err = uiTLS(uiOptions{listen: addr, tlsInFront: true})
		require.NoError(t, err, addr)
	}

	// Stated: plain HTTP off the loopback, saying so.
	p := startUI(t, append(dbEnv(db.Schema), envUIToken+"="+uiToken), "--listen", "0.0.0.0:0", "--tls-terminated-in-front")
	require.True(t, strings.HasPrefix(p.base, "http://"), p.base)
	require.Contains(t, p.stdout.String(), "Plain HTTP, for a proxy in front that terminates TLS")
	code, body := p.do(t, "GET", "/api/v1/relays", "Bearer "+uiToken)
	require.Equal(t, http.StatusOK, code, body)
	p.stop(t)
}

// With --tls-cert and --tls-key, `exactlyonce ui` serves HTTPS, off the
// loopback too: a request over TLS that trusts the certificate succeeds,
// plain HTTP does not, and the login form's cookie is Secure.
func TestUIServesTLS(t *testing.T) {
	t.Parallel()
	requirePostgres(t)
	db := testenv.Schema(t)
	certFile, keyFile, pool := selfSignedCert(t)
	p := startUI(t, append(dbEnv(db.Schema), envUIToken+"="+uiToken), "--listen", "0.0.0.0:0", "--tls-cert", certFile, "--tls-key", keyFile)
	require.True(t, strings.HasPrefix(p.base, "https://"), p.stdout.String())
	p.client.Transport = &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}

	res, err := p.client.Get(p.base + "/api/v1/relays")
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusUnauthorized, res.StatusCode)
	require.NotNil(t, res.TLS, "over TLS")
	code, body := p.do(t, "GET", "/api/v1/relays", "Bearer "+uiToken)
	require.Equal(t, http.StatusOK, code, body)

	res, err = p.client.PostForm(p.base+"/login", url.Values{"token": {uiToken}, "next": {"/"}})
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusSeeOther, res.StatusCode)
	require.Len(t, res.Cookies(), 1)
	require.True(t, res.Cookies()[0].Secure, "the session cookie is sent over HTTPS only")

	res, err = http.Get("http://" + strings.TrimPrefix(p.base, "https://") + "/api/v1/relays")
	require.NoError(t, err)
	_ = res.Body.Close()
	require.Equal(t, http.StatusBadRequest, res.StatusCode, "plain HTTP is not served")
	p.stop(t)
}

// selfSignedCert writes a self-signed certificate for 127.0.0.1 and
// localhost, and its key, to PEM files, and returns them with a pool that
// trusts the certificate.
func selfSignedCert(t *testing.T) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	require.NoError(t, err)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "exactlyonce ui test"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		DNSNames:              []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	require.NoError(t, err)
	cert, err := x509.ParseCertificate(der)
	require.NoError(t, err)
	pool = x509.NewCertPool()
	pool.AddCert(cert)
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	require.NoError(t, err)
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	require.NoError(t, os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600))
	require.NoError(t, os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600))
	return certFile, keyFile, pool
}
