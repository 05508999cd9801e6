package console

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestImportsNoRedisOrBrokerClient: a service that mounts the console over
// PostgreSQL alone must not pull a Redis client (nor the Redis store), a
// broker client or Prometheus into its build and its go.mod through it.
func TestImportsNoRedisOrBrokerClient(t *testing.T) {
	t.Parallel()
	goTool, err := exec.LookPath("go")
	require.NoError(t, err, "the go command, to list the console's dependencies")
	out, err := exec.Command(goTool, "list", "-deps", ".").CombinedOutput()
	require.NoError(t, err, "go list: %s", out)
	for _, dep := range strings.Fields(string(out)) {
		for _, banned := range []string{
			"github.com/redis/",
			"github.com/exactlyonce/watermill-exactlyonce/redisstore",
			"github.com/rabbitmq/",
			"github.com/exactlyonce/watermill-exactlyonce/rabbitmq",
			"github.com/prometheus/",
			"github.com/exactlyonce/watermill-exactlyonce/metrics",
		} {
			require.False(t, strings.HasPrefix(dep, banned), "the console depends on %s", dep)
		}
	}
}
