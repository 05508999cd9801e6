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
var pgbouncerSuite = []string{"./console/", "./inbox/", "./internal/inboxdb/", "./exactlyonce/", "./outbox/", "./sqlschema/"}

// TestCoreSuiteThroughPgBouncer runs the core packages' own test suites
// with DATABASE_URL pointing at a PgBouncer in transaction pooling (pgx in
// exec mode, see testenv.PgBouncerExecMode), as a child `go test`: every
// pool and database/sql handle those tests open goes through it, and their
// clients share a few server connections, so anything that relies on
// session state (SQL-level PREPARE, SET, session advisory locks, temporary
// tables, LISTEN) fails there. DIRECT_DATABASE_URL keeps PostgreSQL itself
// reachable for the few helpers that need a session of their own. The
// nested run has this test binary's time, not a budget of its own (see
// nestedBudget): how busy the machine is does not decide the outcome.
func TestCoreSuiteThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx, childTimeout := nestedBudget(t)
	bouncer := testenv.StartPgBouncer(t, testenv.PgBouncerConfig{PoolMode: "transaction", PoolSize: pgbouncerSuitePoolSize, ReadCommitted: true})
	goBin, err := exec.LookPath("go")
	require.NoError(t, err, "the go command (go test puts GOROOT/bin in PATH)")
	root, err := filepath.Abs("..")
	require.NoError(t, err)

	args := append([]string{"test", "-count=1", "-race", "-timeout=" + childTimeout.String()}, pgbouncerSuite...)
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

// The nested run's budget is this test binary's: a budget of its own (it
// had a fixed 4 minutes) made the test fail when the machine was busy (a
// fresh clone, a second test run beside it) although nothing hung, while
// the parent still had minutes left. The parent's -timeout (t.Deadline) is
// the one hang detector, and the nested run ends inside it: the child's
// -timeout (per child test binary) ends childTimeoutMargin before the
// parent's deadline, so that a hung child test binary is stopped by its own
// timeout, with its goroutine dump in the output reported here; the
// context kills the child's whole process group killMargin before the
// parent's deadline, should the child not end by itself, which leaves the
// parent the time to report the output before its own timeout panics.
// Keeping `make test` within CI's limit is the Makefile's -timeout.
const (
	killMargin         = 30 * time.Second
	childTimeoutMargin = 90 * time.Second
	// minNestedBudget is the least budget the nested run is started with:
	// a parent run with a shorter -timeout fails at once, saying so.
	minNestedBudget = 3 * time.Minute
)

// nestedBudget returns the context the nested `go test` runs under
// (cancelled at cleanup) and its -timeout, from t's deadline; without one
// (go test -timeout 0), no deadline and -timeout 0.
func nestedBudget(t *testing.T) (context.Context, time.Duration) {
	t.Helper()
	deadline, ok := t.Deadline()
	if !ok {
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		return ctx, 0
	}
	left := time.Until(deadline)
	if left-childTimeoutMargin < minNestedBudget {
		t.Fatalf("the test binary's -timeout leaves %s to the nested run of the core suite through PgBouncer, which needs at least %s: run go test with a longer -timeout (make test: 30m)",
			(left - childTimeoutMargin).Round(time.Second), minNestedBudget)
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline.Add(-killMargin))
	t.Cleanup(cancel)
	return ctx, (left - childTimeoutMargin).Truncate(time.Second)
}

// pgbouncerSuitePoolSize is PgBouncer's default_pool_size for the core
// suite. testenv's PgBouncer hands server connections out in turn, so a
// client's consecutive transactions run in different server sessions
// whatever the pool size. With 4, tests that hold a transaction open while
// another client must reach PostgreSQL (to block on its lock, or to watch
// pg_stat_activity) sometimes wait in PgBouncer's queue instead, when
// parallel tests hold the other server connections, and time out.
const pgbouncerSuitePoolSize = 10
