package testenv

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

// DirectDatabaseURL is $DIRECT_DATABASE_URL, or DatabaseURL(): the
// PostgreSQL server itself. A suite run through PgBouncer (DATABASE_URL
// pointing at it) sets DIRECT_DATABASE_URL so that what needs the server
// (the target of another PgBouncer, a session of its own) still reaches it.
func DirectDatabaseURL() string {
	if u := os.Getenv("DIRECT_DATABASE_URL"); u != "" {
		return u
	}
	return DatabaseURL()
}

// ListenConnString is what a test's outbox.RelayConfig.ListenConnString
// should be for the relay to wake on commit: empty (listen on a connection
// of DB.Conn's own) when the suite talks to PostgreSQL directly, the direct
// address when it runs through PgBouncer (DIRECT_DATABASE_URL set), where
// a LISTEN on DB.Conn cannot hold — as a user behind PgBouncer would set it.
func ListenConnString() string {
	return os.Getenv("DIRECT_DATABASE_URL")
}

// PgBouncerExecMode is the pgx default_query_exec_mode that PgBouncer URLs
// carry. PgBouncer 1.18 in transaction pooling does not keep protocol-level
// prepared statements (pgx's default cache_statement mode names them per
// connection, and the next transaction may run on another server
// connection). "exec" sends each query as the unnamed statement, parse to
// execute in one round trip, with the parameters apart from the SQL (as
// text; PostgreSQL infers their types). simple_protocol passes the same
// suites but interpolates the parameters into the SQL text on the client;
// we test with what we recommend (docs/pgbouncer.md).
const PgBouncerExecMode = "exec"

// PgBouncerConfig configures StartPgBouncer.
type PgBouncerConfig struct {
	// PoolMode is PgBouncer's pool_mode: session, transaction or statement.
	PoolMode string
	// PoolSize is default_pool_size, the number of server connections
	// shared by all clients. Defaults to 4, so that they really are shared.
	PoolSize int
	// MaxClients is max_client_conn. Defaults to 1000.
	MaxClients int
	// TargetURL is the PostgreSQL server PgBouncer connects to (host, port,
	// database, user). Defaults to DirectDatabaseURL(); a test that cuts the
	// server connections points it at a Proxy.
	TargetURL string
	// ServerLoginRetry is server_login_retry in seconds: how long PgBouncer
	// refuses clients after a failed login to the server before it tries
	// again. 0 keeps PgBouncer's default (15).
	ServerLoginRetry int
	// ReadCommitted makes PgBouncer's server connections READ COMMITTED
	// whatever the database's default (connect_query), as the suite's own
	// direct connections are (see Pool): PgBouncer refuses the startup
	// parameter that asks for it. For the core suite run through it.
	ReadCommitted bool
	// Supervise, when set, restarts a pgbouncer that ends before the test
	// does, on the same port, and records the crash there instead of
	// failing the test: for fault tests, where the pooler crashing is one
	// more fault the system under test must survive.
	Supervise *PgBouncerSupervisor
}

// PgBouncerSupervisor records the crashes of a supervised pgbouncer (see
// PgBouncerConfig.Supervise).
type PgBouncerSupervisor struct {
	mu       sync.Mutex
	crashes  []string
	current  *pgbouncerProc
	stopping bool
}

// Crashes returns, for each time pgbouncer ended on its own and was
// restarted, the last lines of its log.
func (s *PgBouncerSupervisor) Crashes() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.crashes...)
}

// supervise restarts p's pgbouncer whenever it ends, until stop.
func (s *PgBouncerSupervisor) supervise(p *pgbouncerProc, restart func() (*pgbouncerProc, error), logTail func() string) {
	s.mu.Lock()
	s.current = p
	s.mu.Unlock()
	go func() {
		for {
			s.mu.Lock()
			cur := s.current
			s.mu.Unlock()
			<-cur.done
			s.mu.Lock()
			if s.stopping {
				s.mu.Unlock()
				return
			}
			s.crashes = append(s.crashes, fmt.Sprintf("%v\n%s", cur.waitErr, logTail()))
			s.mu.Unlock()
			var next *pgbouncerProc
			var err error
			for try := 0; try < 50; try++ {
				if next, err = restart(); err == nil {
					break
				}
				time.Sleep(100 * time.Millisecond)
			}
			if err != nil {
				s.mu.Lock()
				s.crashes = append(s.crashes, "restart failed: "+err.Error())
				s.mu.Unlock()
				return
			}
			s.mu.Lock()
			s.current = next
			if s.stopping {
				s.mu.Unlock()
				next.stop()
				return
			}
			s.mu.Unlock()
		}
	}()
}

// stop stops the current pgbouncer and the supervision.
func (s *PgBouncerSupervisor) stop() {
	s.mu.Lock()
	s.stopping = true
	cur := s.current
	s.mu.Unlock()
	if cur != nil {
		cur.stop()
	}
}

// PgBouncer starts a PgBouncer in the given pool mode in front of
// DirectDatabaseURL() with 4 server connections, READ COMMITTED as the
// suite's own connections are (PgBouncerConfig.ReadCommitted), and returns
// a DATABASE_URL for it. See StartPgBouncer.
func PgBouncer(t testing.TB, mode string) string {
	t.Helper()
	return StartPgBouncer(t, PgBouncerConfig{PoolMode: mode, ReadCommitted: true})
}

// StartPgBouncer starts a pgbouncer process listening on a free loopback
// port, in front of the database of DirectDatabaseURL() (every client is
// connected as that URL's user, postgres by default: auth_type any), waits
// until a query goes through it, and returns a URL for it with
// default_query_exec_mode=PgBouncerExecMode. Its configuration and log live
// in a temporary directory. At cleanup it is stopped (SIGTERM, then
// SIGKILL), waited for, and the directory removed; when the test failed, or
// pgbouncer ended before cleanup, the end of its log goes to the test log.
// Running as root, pgbouncer runs as the postgres user (it refuses to run
// as root). It is also killed when the test process dies.
//
// When pgbouncer is not installed the test fails (never skips) with a hint
// to run `make services`.
func StartPgBouncer(t testing.TB, cfg PgBouncerConfig) string {
	t.Helper()
	if cfg.PoolSize == 0 {
		cfg.PoolSize = 4
	}
	if cfg.MaxClients == 0 {
		cfg.MaxClients = 1000
	}
	switch cfg.PoolMode {
	case "session", "transaction", "statement":
	default:
		t.Fatalf("testenv: PgBouncer pool mode %q (want session, transaction or statement)", cfg.PoolMode)
	}
	bin, err := pgbouncerPath()
	require.NoError(t, err)

	if cfg.TargetURL == "" {
		cfg.TargetURL = DirectDatabaseURL()
	}
	target, err := url.Parse(cfg.TargetURL)
	require.NoError(t, err, "DATABASE_URL")
	dbname := strings.TrimPrefix(target.Path, "/")
	if dbname == "" {
		dbname = "postgres"
	}
	host, port := target.Hostname(), target.Port()
	if host == "" {
		host = "127.0.0.1"
	}
	if port == "" {
		port = "5432"
	}
	dbUser := target.User.Username()
	if dbUser == "" {
		dbUser = "postgres"
	}
	password, _ := target.User.Password()
	for _, v := range []string{host, port, dbname, dbUser, password} {
		if v != "" && !plainIniValue(v) {
			t.Fatalf("testenv: PgBouncer: %q in DATABASE_URL cannot be written into pgbouncer.ini unquoted", v)
		}
	}

	dir, err := os.MkdirTemp("", "eo-pgbouncer-")
	require.NoError(t, err)
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	var cred *syscall.Credential
	if os.Geteuid() == 0 {
		u, err := user.Lookup("postgres")
		require.NoError(t, err, "running as root, pgbouncer must run as the postgres user")
		uid, _ := strconv.Atoi(u.Uid)
		gid, _ := strconv.Atoi(u.Gid)
		cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		require.NoError(t, os.Chown(dir, uid, gid))
	}

	// A free port can be taken between our probe and pgbouncer's bind:
	// try a few.
	var lastErr error
	for attempt := 0; attempt < 3; attempt++ {
		listenPort, err := freePort()
		require.NoError(t, err)
		entry := fmt.Sprintf("host=%s port=%s dbname=%s user=%s", host, port, dbname, dbUser)
		if password != "" {
			entry += " password=" + password
		}
		if cfg.ReadCommitted {
			entry += " connect_query=" + pgbouncerQuote("SET default_transaction_isolation = 'read committed'")
		}
		logfile := filepath.Join(dir, "pgbouncer.log")
		ini := strings.Join([]string{
			"[databases]",
			dbname + " = " + entry,
			"",
			"[pgbouncer]",
			"listen_addr = 127.0.0.1",
			"listen_port = " + strconv.Itoa(listenPort),
			"unix_socket_dir =",
			"auth_type = any",
			"pool_mode = " + cfg.PoolMode,
			"default_pool_size = " + strconv.Itoa(cfg.PoolSize),
			"min_pool_size = 0",
			"reserve_pool_size = 0",
			// Hand out idle server connections in turn, not the most
			// recently used first: a client's consecutive transactions then
			// land on different server sessions even under light load.
			"server_round_robin = 1",
			"max_client_conn = " + strconv.Itoa(cfg.MaxClients),
			"logfile = " + logfile,
			"log_connections = 0",
			"log_disconnections = 0",
			"ignore_startup_parameters = extra_float_digits",
			"",
		}, "\n")
		if cfg.ServerLoginRetry > 0 {
			ini += "server_login_retry = " + strconv.Itoa(cfg.ServerLoginRetry) + "\n"
		}
		iniPath := filepath.Join(dir, "pgbouncer.ini")
		require.NoError(t, os.WriteFile(iniPath, []byte(ini), 0o644))
		if cred != nil {
			require.NoError(t, os.Chown(iniPath, int(cred.Uid), int(cred.Gid)))
		}

		p, err := startPgBouncer(bin, iniPath, filepath.Join(dir, "stderr.log"), cred)
		require.NoError(t, err)
		u := url.URL{
			Scheme: "postgres",
			User:   target.User,
			Host:   net.JoinHostPort("127.0.0.1", strconv.Itoa(listenPort)),
			Path:   "/" + dbname,
		}
		q := target.Query()
		q.Set("sslmode", "disable")
		q.Set("default_query_exec_mode", PgBouncerExecMode)
		u.RawQuery = q.Encode()
		if lastErr = p.waitReady(u.String(), 20*time.Second); lastErr != nil {
			p.stop()
			lastErr = fmt.Errorf("%w\n%s", lastErr, tail(logfile, filepath.Join(dir, "stderr.log")))
			continue
		}
		if sv := cfg.Supervise; sv != nil {
			stderrPath := filepath.Join(dir, "stderr.log")
			sv.supervise(p, func() (*pgbouncerProc, error) {
				return startPgBouncer(bin, iniPath, stderrPath, cred)
			}, func() string { return tail(logfile, stderrPath) })
			t.Cleanup(func() {
				sv.stop()
				if t.Failed() {
					t.Logf("testenv: end of the pgbouncer log:\n%s", tail(logfile, stderrPath))
				}
			})
			return u.String()
		}
		t.Cleanup(func() {
			exitedEarly := p.exited()
			p.stop()
			if exitedEarly {
				t.Errorf("testenv: pgbouncer ended before the test did (%v)\n%s", p.waitErr, tail(logfile, filepath.Join(dir, "stderr.log")))
			} else if t.Failed() {
				t.Logf("testenv: end of the pgbouncer log:\n%s", tail(logfile, filepath.Join(dir, "stderr.log")))
			}
		})
		return u.String()
	}
	t.Fatalf("testenv: pgbouncer did not start: %v", lastErr)
	return ""
}

// pgbouncerPath finds pgbouncer in PATH or /usr/sbin.
func pgbouncerPath() (string, error) {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	const debian = "/usr/sbin/pgbouncer"
	if fi, err := os.Stat(debian); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
		return debian, nil
	}
	return "", errors.New("testenv: pgbouncer is not installed (looked in PATH and /usr/sbin); `make services` installs it (Debian package pgbouncer)")
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer func() { _ = ln.Close() }()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// plainIniValue reports whether s can be written into pgbouncer.ini
// unquoted, as a database name or a connection-string value.
func plainIniValue(s string) bool {
	return s != "" && !strings.ContainsFunc(s, func(r rune) bool {
		return r <= ' ' || r == 0x7f || strings.ContainsRune(`'"\=;#[]`, r)
	})
}

type pgbouncerProc struct {
	cmd     *exec.Cmd
	done    chan struct{}
	waitErr error
}

func startPgBouncer(bin, iniPath, stderrPath string, cred *syscall.Credential) (*pgbouncerProc, error) {
	stderr, err := os.Create(stderrPath)
	if err != nil {
		return nil, err
	}
	defer func() { _ = stderr.Close() }()
	cmd := exec.Command(bin, iniPath)
	cmd.Stdout = stderr
	cmd.Stderr = stderr
	// Credential instead of pgbouncer's -u: Go drops privileges before
	// exec and sets the parent-death signal after, so that pgbouncer dies
	// with the test process (-u would switch user later and clear it).
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("testenv: starting %s: %w", bin, err)
	}
	p := &pgbouncerProc{cmd: cmd, done: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

func (p *pgbouncerProc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// waitReady waits until a query goes through pgbouncer to PostgreSQL.
func (p *pgbouncerProc) waitReady(connString string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	var err error
	for time.Now().Before(deadline) {
		if p.exited() {
			if p.waitErr == nil {
				return errors.New("pgbouncer exited with status 0")
			}
			return fmt.Errorf("pgbouncer exited: %w", p.waitErr)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		var conn *pgx.Conn
		conn, err = pgx.Connect(ctx, connString)
		if err == nil {
			var one int
			err = conn.QueryRow(ctx, "SELECT 1").Scan(&one)
			_ = conn.Close(ctx)
		}
		cancel()
		if err == nil {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("no query went through pgbouncer within %s: %w", timeout, err)
}

// stop ends pgbouncer (SIGTERM: immediate shutdown in 1.18) and waits for
// it; SIGKILL after 10 seconds.
func (p *pgbouncerProc) stop() {
	if p.exited() {
		return
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

// tail returns the last lines of pgbouncer's log file, or of its stderr
// when the log is empty (an error before pgbouncer opened it), for failure
// messages.
func tail(logfile, stderr string) string {
	for _, path := range []string{logfile, stderr} {
		data, err := os.ReadFile(path)
		if err != nil || len(data) == 0 {
			continue
		}
		lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
		if len(lines) > 40 {
			lines = lines[len(lines)-40:]
		}
		return fmt.Sprintf("--- %s\n%s\n", path, strings.Join(lines, "\n"))
	}
	return "(pgbouncer wrote no log)"
}

// pgbouncerQuote quotes a value of pgbouncer.ini's [databases] entries:
// in single quotes, a single quote doubled.
func pgbouncerQuote(v string) string { return "'" + strings.ReplaceAll(v, "'", "''") + "'" }
