package tests

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// pgbouncerSuite is what TestCoreSuiteThroughPgBouncer runs: the core
// packages' own tests.
var pgbouncerSuite = []string{"./console/", "./inbox/", "./internal/inboxdb/", "./middleware/", "./outbox/", "./sqlschema/"}

// TestCoreSuiteThroughPgBouncer runs the core packages' own test suites
// with DATABASE_URL pointing at a PgBouncer in transaction pooling (pgx in
// exec mode, see testenv.PgBouncerExecMode), as a child `go test`: every
// pool and database/sql handle those tests open goes through it, and their
// clients share a few server connections, so anything that relies on
// session state (SQL-level PREPARE, SET, session advisory locks, temporary
// tables, LISTEN) fails there. DIRECT_DATABASE_URL keeps PostgreSQL itself
// reachable for the few helpers that need a session of their own.
func TestCoreSuiteThroughPgBouncer(t *testing.T) {
	t.Parallel()
	bouncer := testenv.StartPgBouncer(t, testenv.PgBouncerConfig{PoolMode: "transaction", PoolSize: pgbouncerSuitePoolSize})
	goBin, err := exec.LookPath("go")
	require.NoError(t, err, "the go command (go test puts GOROOT/bin in PATH)")
	root, err := filepath.Abs("..")
	require.NoError(t, err)

	// The child's own -timeout ends a hung test binary with its goroutine
	// dump in the output; the context is the backstop.
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	args := append([]string{"test", "-count=1", "-race", "-timeout=3m"}, pgbouncerSuite...)
	cmd := exec.CommandContext(ctx, goBin, args...)
	cmd.Dir = root
	// go test runs the test binaries as its children: kill the whole
	// process group, not only go, so that none is left behind.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	cmd.Env = append(os.Environ(),
		"DATABASE_URL="+bouncer,
		"DIRECT_DATABASE_URL="+testenv.DirectDatabaseURL(),
	)
	start := time.Now()
	out, err := cmd.CombinedOutput()
	t.Logf("go %v through PgBouncer (%s): %s", args, bouncer, time.Since(start).Round(time.Second))
	if err != nil {
		t.Fatalf("the core suite failed through PgBouncer in transaction pooling: %v\n%s", err, out)
	}
}

// pgbouncerSuitePoolSize is PgBouncer's default_pool_size for the core
// suite. testenv's PgBouncer hands server connections out in turn, so a
// client's consecutive transactions run in different server sessions
// whatever the pool size. With 4, tests that hold a transaction open while
// another client must reach PostgreSQL (to block on its lock, or to watch
// pg_stat_activity) sometimes wait in PgBouncer's queue instead, when
// parallel tests hold the other server connections, and time out.
const pgbouncerSuitePoolSize = 10
