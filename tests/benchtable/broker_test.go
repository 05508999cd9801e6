package main

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseBrokerSetups(t *testing.T) {
	got, err := parseBrokerSetups(" cluster-spread,classic , quorum")
	require.NoError(t, err)
	require.Equal(t, []string{"classic", "quorum", "cluster-spread"}, got, "the order they print in, whatever the flag's")

	for _, bad := range []string{"", "classic", "quorum,cluster", "classic,quorum,quorum", "classic,mirrored"} {
		_, err := parseBrokerSetups(bad)
		require.Error(t, err, "%q", bad)
	}
}

func TestBrokerFlags(t *testing.T) {
	for _, v := range []string{"BENCH_QUICK", "BENCH_ONLY", "BENCH_BROKER_SETUPS", "BENCH_BROKER_ROWS", "BENCH_BROKER_MESSAGES", "BENCH_BROKER_RELAY_WORKERS"} {
		t.Setenv(v, "") // empty is unset
	}
	cfg, err := parseConfig([]string{"-quick", "-only", "broker", "-broker-setups", "classic,cluster", "-broker-relay-workers", "2"})
	require.NoError(t, err)
	require.True(t, cfg.only["broker"])
	require.Equal(t, []string{"classic", "cluster"}, cfg.brokerSetups)
	require.Equal(t, []int{2}, cfg.brokerWorkers)
	require.Equal(t, 500, cfg.brokerRows)

	cfg, err = parseConfig(nil)
	require.NoError(t, err)
	require.False(t, cfg.only["broker"], "the full table leaves the broker section out: it starts a cluster")
	require.Equal(t, 10000, cfg.brokerMessages)
}
