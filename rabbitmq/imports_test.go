package rabbitmq_test

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestImportsNoDatabaseDriver: a service that only publishes to or consumes
// from RabbitMQ must not pull the outbox, the middleware or a database driver
// into its build through this package (the contracts it shares with the
// outbox are in package msgid).
func TestImportsNoDatabaseDriver(t *testing.T) {
	t.Parallel()
	goTool, err := exec.LookPath("go")
	require.NoError(t, err, "the go command, to list the package's dependencies")
	out, err := exec.Command(goTool, "list", "-deps", ".").CombinedOutput()
	require.NoError(t, err, "go list: %s", out)
	for _, dep := range strings.Fields(string(out)) {
		for _, banned := range []string{
			"github.com/jackc/",
			"github.com/lib/pq",
			"github.com/exactlyonce/watermill-exactlyonce/outbox",
			"github.com/exactlyonce/watermill-exactlyonce/exactlyonce",
			"github.com/exactlyonce/watermill-exactlyonce/sqlschema",
		} {
			require.False(t, strings.HasPrefix(dep, banned), "package rabbitmq depends on %s", dep)
		}
	}
}
