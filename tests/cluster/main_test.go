// Package cluster_test proves the library's guarantees beyond one broker and
// one database server: a three-node RabbitMQ cluster with quorum queues
// (node crashes, leader moves, a lost majority) and a PostgreSQL primary
// with a streaming standby (failover, per replication setting). TestMain
// starts the cluster (scripts/rabbit-cluster.sh) and stops it at the end;
// each failover test makes a fresh primary and standby (scripts/pg-pair.sh).
// See docs/clusters.md.
package cluster_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// rabbit is the three-node cluster every test of the package shares.
var rabbit *testenv.RabbitCluster

func TestMain(m *testing.M) {
	c, err := testenv.StartRabbitCluster(5690, "eo-rmq")
	if err != nil {
		fmt.Fprintf(os.Stderr, "tests/cluster: cannot start the three-node RabbitMQ cluster (`make services` installs RabbitMQ; `make cluster-up` starts the cluster alone): %v\n", err)
		os.Exit(1)
	}
	rabbit = c
	code := m.Run()
	if os.Getenv("EO_CLUSTER_KEEP") == "" {
		if err := c.Stop(); err != nil {
			fmt.Fprintf(os.Stderr, "tests/cluster: stopping the cluster: %v\n", err)
		}
	}
	os.Exit(code)
}

// pgPair makes a fresh PostgreSQL primary (node a) and standby (node b) for
// t, and removes them when t ends. Tests that use it do not run in parallel
// (the pair has fixed ports).
func pgPair(t *testing.T) *testenv.PGPair {
	t.Helper()
	p, err := testenv.StartPGPair()
	if err != nil {
		t.Fatalf("cannot start the PostgreSQL primary and standby: %v", err)
	}
	t.Cleanup(func() {
		if os.Getenv("EO_CLUSTER_KEEP") == "" {
			if err := p.Stop(); err != nil {
				t.Logf("stopping the PostgreSQL pair: %v", err)
			}
		}
	})
	return p
}
