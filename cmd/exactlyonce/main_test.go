package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// binary is the exactlyonce command built by TestMain; the tests run it as
// an operator would.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "exactlyonce-cli-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "exactlyonce")
	args := []string{"build", "-o", binary}
	if raceBuild {
		args = append(args, "-race") // the command under test runs with the race detector too
	}
	build := exec.Command("go", append(args, ".")...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building the exactlyonce command:", err)
		_ = os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	_ = os.RemoveAll(dir)
	os.Exit(code)
}

// result is what one run of the command printed and its exit status.
type result struct {
	stdout, stderr string
	code           int
	took           time.Duration
}

func (r result) String() string {
	return fmt.Sprintf("exit status %d\n--- stdout:\n%s--- stderr:\n%s", r.code, r.stdout, r.stderr)
}

// cli runs the command with args and env (KEY=value entries) on top of an
// environment cleared of the variables the command reads, so that only what
// the test states configures it. It gives the command a minute.
func cli(t *testing.T, env []string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	cmd.Env = append(cleanEnv(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	res := result{stdout: stdout.String(), stderr: stderr.String(), took: time.Since(start)}
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit):
		res.code = exit.ExitCode()
	default:
		require.NoError(t, err, "running %v", args)
	}
	require.NoError(t, ctx.Err(), "the command did not end within a minute: %v\n%s", args, res)
	return res
}

// cleanEnv is the test's environment without the variables the command
// reads.
func cleanEnv() []string {
	var out []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		switch name {
		case envDatabaseURL, envAMQPURL, envSchema, envInboxTable, envOutboxTable, envPartitions:
			continue
		}
		out = append(out, kv)
	}
	return out
}

// requireOK asserts exit status 0 and nothing on stderr but log lines.
func requireOK(t *testing.T, r result) {
	t.Helper()
	require.Equal(t, 0, r.code, "%s", r)
}

// requireExit asserts a failure with code: nothing on stdout, and an error
// on stderr that starts with "exactlyonce: ", contains want, and holds no
// stack trace.
func requireExit(t *testing.T, r result, code int, want string) {
	t.Helper()
	require.Equal(t, code, r.code, "%s", r)
	require.Empty(t, r.stdout, "a failed command prints nothing on stdout\n%s", r)
	lines := strings.Split(strings.TrimSpace(r.stderr), "\n")
	require.True(t, strings.HasPrefix(lines[0], "exactlyonce: "), "%s", r)
	require.Contains(t, lines[0], want, "%s", r)
	require.NotContains(t, r.stderr, "goroutine ", "no stack trace\n%s", r)
	if code == exitUsage {
		require.Len(t, lines, 2, "the error, then where the usage is\n%s", r)
		require.Contains(t, lines[1], "--help")
	} else {
		require.Len(t, lines, 1, "one line\n%s", r)
	}
}

// decode parses the single JSON document of r's stdout into v.
func decode(t *testing.T, r result, v any) {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(r.stdout))
	dec.DisallowUnknownFields()
	require.NoError(t, dec.Decode(v), "%s", r)
	require.False(t, dec.More(), "one JSON document\n%s", r)
}

// dbEnv is the environment that points the command at the test database
// and at db's schema.
func dbEnv(schema string) []string {
	return []string{envDatabaseURL + "=" + testenv.DatabaseURL(), envSchema + "=" + schema}
}

// engineEnv is the environment that points the command at the bundle's
// engine and schema: PostgreSQL's test database (DatabaseURL) and the
// bundle's schema, or MySQL/MariaDB's server (MySQLURL) and the bundle's
// database, which is the CLI's --schema on MySQL.
func engineEnv(b *testenv.Bundle) []string {
	if b.MySQL() {
		return []string{envDatabaseURL + "=" + testenv.MySQLURL(), envSchema + "=" + b.DB.Schema}
	}
	return dbEnv(b.DB.Schema)
}

// requirePostgres skips the test when PostgreSQL is unreachable, and fails
// it instead when CI=true.
func requirePostgres(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, testenv.DatabaseURL())
	if err != nil {
		unavailable(t, fmt.Sprintf("PostgreSQL at %s: %v", testenv.DatabaseURL(), err))
		return
	}
	_ = conn.Close(ctx)
}

// requireRabbitMQ skips the test when RabbitMQ is unreachable, and fails it
// instead when CI=true.
func requireRabbitMQ(t *testing.T) {
	t.Helper()
	conn, err := amqp091.DialConfig(testenv.AMQPURL(), amqp091.Config{Dial: amqp091.DefaultDial(3 * time.Second)})
	if err != nil {
		unavailable(t, fmt.Sprintf("RabbitMQ at %s: %v", testenv.AMQPURL(), err))
		return
	}
	_ = conn.Close()
}

func unavailable(t *testing.T, what string) {
	t.Helper()
	if os.Getenv("CI") == "true" {
		t.Fatalf("service unreachable (`make services` starts it): %s", what)
	}
	t.Skipf("service unreachable (run `make services`, or set DATABASE_URL / AMQP_URL): %s", what)
}

// freshSchema returns a unique schema name that does not exist yet, dropped
// at cleanup if the test created it.
func freshSchema(t *testing.T) string {
	t.Helper()
	name := testenv.Unique(t, "cli_")
	pool := testenv.Pool(t)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{name}.Sanitize()+" CASCADE")
		require.NoError(t, err)
	})
	return name
}

func testCtx(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}
