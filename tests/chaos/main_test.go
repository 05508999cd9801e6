// Package chaos is the chaos suite: several worker processes (consumers in
// transactional or lease mode, the outbox relay, a downstream consumer; see
// ./worker) run against real PostgreSQL (or MariaDB: the runs @mariadb and
// @mariadb-rc) and RabbitMQ behind TCP proxies, while the harness publishes
// messages with duplicates and injects faults on a bounded schedule: SIGKILL
// of consumers and of the relay, database connections terminated (MariaDB:
// KILLed), the database and RabbitMQ refusing connections, handler panics
// and handlers slower than their lease. Then it checks the invariants
// (nothing lost, no duplicate effect, lease-mode repeats only where an
// attempt was interrupted, ...) and prints them as one table.
//
// TestChaosOrdered runs per-key order end to end (writers, two relay
// processes, two consumer processes on partitioned queues; on PostgreSQL
// and on MariaDB) under broker connection cuts and SIGKILLs, with poison
// messages that block their key until discarded, and shows the unordered
// setup failing the same check.
//
// The cluster runs (mode+cluster, in both tests) put RabbitMQ on a
// three-node cluster with quorum queues (partitions: quorum queues with a
// single active consumer), every worker knowing the three nodes, and SIGKILL
// the nodes: each in turn (the leader of the queues, the relay's node), and
// two at once for 10 s (a majority lost). See cluster_test.go.
//
// Two tests stress one part in process: TestChaosRelay (two relays under a
// flapping broker, back-pressure and poison rows) and
// TestPartitionedChaosPurgesDuringTraffic (the partitioned inbox purged
// during traffic while partition maintenance is behind).
//
// `make test` runs the short form (800 messages, 3 faults of each kind; the
// MariaDB runs 500 and 2; group commit on the cluster, 400 messages, 1 fault
// of each kind; per-key order with the transactional consumer on each
// engine and on the cluster); `make chaos` the full one (5,000 messages, 10
// faults of each kind, 3 of each cluster fault; per-key order in every
// consumer mode, on both engines, and both transactional modes on the
// cluster). See TestChaos for the environment variables.
package chaos

import (
	"flag"
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"
)

// TestMain starts the three-node RabbitMQ cluster in the background when the
// selected runs hold a cluster run (mode+cluster), stops it at the end, and
// fails the run if a goroutine of the harness (proxies, provider, event
// sink, publisher, process waiters) outlives the tests.
func TestMain(m *testing.M) {
	flag.Parse()
	if f := flag.Lookup("test.run"); f != nil && clusterSelected(f.Value.String()) {
		startClusterAsync()
	}
	code := m.Run()
	stopCluster()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: Errors on successful test run: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}
