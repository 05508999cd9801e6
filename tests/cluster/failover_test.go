package cluster_test

import (
	"os"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// failoverMessages is the number of messages of each failover run:
// EO_FAILOVER_MESSAGES for a long form, 600 by default.
func failoverMessages() int {
	if n, err := strconv.Atoi(os.Getenv("EO_FAILOVER_MESSAGES")); err == nil && n > 0 {
		return n
	}
	return 600
}

// TestFailover: the primary is killed mid-run (a third of the effects in)
// and the standby promoted; the middleware (through the multi-host URL,
// target_session_attrs=read-write) and the relay (its LISTEN too) go on by
// themselves. Per replication setting, what is lost or repeated (see
// docs/clusters.md):
//
//   - synchronous, remote_apply or on (the standby named in
//     synchronous_standby_names): a COMMIT returns only once the standby
//     has the commit, so every input the broker saw acked has its effect
//     on the promoted node: 0 lost, 0 duplicate effects. Outputs can be
//     delivered twice: a relay batch published before the crash whose
//     DELETE did not commit is published again by the promoted node
//     (at-least-once; the downstream inbox drops them);
//   - asynchronous: a COMMIT returns before the standby has it. On
//     loopback the standby is usually current and nothing is lost; with
//     the standby's WAL stalled for a second before the crash (the run
//     "async, WAL stalled"), the commits of that second are on the crashed
//     primary only: their inputs were acked, the broker does not redeliver
//     them, and their effects are lost. The run counts them and checks
//     that each is on the crashed primary (restarted alone) and not on the
//     promoted node, and that nothing is duplicated.
//
// The relay keeps each ordering key's order on the promoted node: the
// outputs of b's effects, first deliveries, arrive in b's commit order.
func TestFailover(t *testing.T) {
	n := failoverMessages()
	runs := []struct {
		name string
		run  failoverRun
	}{
		{"sync remote_apply", failoverRun{replication: "remote_apply", messages: n}},
		{"sync on, group commit", failoverRun{replication: "on", batch: true, messages: n}},
		{"async", failoverRun{replication: "async", messages: n}},
		{"async, WAL stalled", failoverRun{replication: "async", stall: true, batch: true, messages: n}},
	}
	for _, c := range runs {
		t.Run(c.name, func(t *testing.T) {
			f := runFailover(t, c.run)
			logFigures(t, c.name, f)
			require.Zero(t, f.duplicates, "no input has two effects")
			require.Zero(t, f.quarantined, "nothing quarantined")
			require.Zero(t, f.undelivered, "every effect on the promoted node has its output delivered")
			require.Zero(t, f.orderBreaks, "per key, the outputs arrive in the promoted node's commit order")
			require.Zero(t, f.nowhere, "every lost effect is on the crashed primary: a commit acked to the broker, not replicated")
			require.Equal(t, f.lost, f.onlyOnA, "lost effects are exactly the commits only the crashed primary has")
			switch {
			case c.run.replication != "async":
				require.Zero(t, f.lost, "synchronous replication loses no effect")
			case c.run.stall:
				require.Positive(t, f.lost, "with the standby's WAL stalled, the commits of the stall are lost")
			}
		})
	}
}
