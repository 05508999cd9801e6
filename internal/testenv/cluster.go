package testenv

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// scriptsDir is the repository's scripts/ directory, found from this file.
func scriptsDir() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "scripts")
}

// runScript runs scripts/<name> with args and env (added to the process's),
// bounded by timeout, and returns its standard output; an error carries its
// standard error.
func runScript(timeout time.Duration, env []string, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", append([]string{filepath.Join(scriptsDir(), name)}, args...)...)
	cmd.Env = append(os.Environ(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return stdout.String(), fmt.Errorf("scripts/%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return stdout.String(), nil
}

// RabbitCluster is a local three-node RabbitMQ cluster of
// scripts/rabbit-cluster.sh: nodes 1, 2 and 3 (<name>1..3@localhost) on
// 127.0.0.1:base+1..base+3. Test packages that run at the same time use
// clusters of their own (other bases and names).
type RabbitCluster struct {
	base int
	name string
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func (c *RabbitCluster) env() []string {
	return []string{fmt.Sprintf("EO_RMQ_PORT_BASE=%d", c.base), "EO_RMQ_NAME=" + c.name}
}

func (c *RabbitCluster) node(n int) string { return fmt.Sprintf("%s%d@localhost", c.name, n) }

// StartRabbitCluster starts the three nodes of the cluster at base (AMQP
// ports base+1..3) named name (those not running) and waits until they form
// a cluster (~30 s from nothing on the 2-core machine). EO_RMQ_PORT_BASE and
// EO_RMQ_NAME, when set, override base and name.
func StartRabbitCluster(base int, name string) (*RabbitCluster, error) {
	c := &RabbitCluster{base: envInt("EO_RMQ_PORT_BASE", base), name: name}
	if n := os.Getenv("EO_RMQ_NAME"); n != "" {
		c.name = n
	}
	if _, err := runScript(3*time.Minute, c.env(), "rabbit-cluster.sh", "up"); err != nil {
		return nil, err
	}
	return c, nil
}

// Stop stops the nodes and removes their data.
func (c *RabbitCluster) Stop() error {
	_, err := runScript(time.Minute, c.env(), "rabbit-cluster.sh", "down")
	return err
}

// URL is node n's AMQP URL (n is 1, 2 or 3).
func (c *RabbitCluster) URL(n int) string {
	return fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", c.base+n)
}

// URLs are the three nodes' AMQP URLs, starting with node first (1, 2 or
// 3) and going round: the order a client given them tries them in.
func (c *RabbitCluster) URLs(first int) []string {
	urls := make([]string, 0, 3)
	for i := range 3 {
		urls = append(urls, c.URL((first-1+i)%3+1))
	}
	return urls
}

// Node is the node (1, 2 or 3) whose AMQP port is in url, or 0.
func (c *RabbitCluster) Node(url string) int {
	for n := 1; n <= 3; n++ {
		if strings.Contains(url, fmt.Sprintf(":%d/", c.base+n)) {
			return n
		}
	}
	return 0
}

// Kill kills node n with SIGKILL: a crash, without a goodbye to its
// clients or its peers.
func (c *RabbitCluster) Kill(n int) error {
	_, err := runScript(time.Minute, c.env(), "rabbit-cluster.sh", "kill", fmt.Sprint(n))
	return err
}

// Start starts node n again; it rejoins the cluster with its data. It
// returns once the node listens for AMQP.
func (c *RabbitCluster) Start(n int) error {
	_, err := runScript(3*time.Minute, c.env(), "rabbit-cluster.sh", "start", fmt.Sprint(n))
	return err
}

// QueueInfo is what the cluster says of one queue.
type QueueInfo struct {
	Name     string   `json:"name"`
	Type     string   `json:"type"`
	Leader   string   `json:"leader"`
	Members  []string `json:"members"`
	Messages int      `json:"messages"` // -1: unknown (no leader)
}

// LeaderNode is the node number (1..3) of q's leader, 0 if none.
func (c *RabbitCluster) LeaderNode(q QueueInfo) int {
	for n := 1; n <= 3; n++ {
		if q.Leader == c.node(n) {
			return n
		}
	}
	return 0
}

// Queues lists the cluster's queues whose name starts with prefix, as the
// first running node of via (node numbers) sees them.
func (c *RabbitCluster) Queues(prefix string, via ...int) ([]QueueInfo, error) {
	if len(via) == 0 {
		via = []int{1, 2, 3}
	}
	var lastErr error
	for _, n := range via {
		node := c.node(n)
		out, err := exec.Command("runuser", "-u", "rabbitmq", "--", "env", "HOME=/var/lib/rabbitmq",
			"/usr/lib/rabbitmq/bin/rabbitmqctl", "-n", node, "-q", "-t", "20", "list_queues",
			"name", "type", "leader", "members", "messages", "--formatter", "json").Output()
		if err != nil {
			lastErr = fmt.Errorf("rabbitmqctl -n %s list_queues: %w", node, err)
			continue
		}
		var all []QueueInfo
		if err := json.Unmarshal(out, &all); err != nil {
			// messages is "" for a queue without a leader.
			var loose []map[string]any
			if err2 := json.Unmarshal(out, &loose); err2 != nil {
				return nil, fmt.Errorf("rabbitmqctl list_queues: %w: %s", err, out)
			}
			all = all[:0]
			for _, m := range loose {
				q := QueueInfo{}
				q.Name, _ = m["name"].(string)
				q.Type, _ = m["type"].(string)
				q.Leader, _ = m["leader"].(string)
				if ms, ok := m["members"].([]any); ok {
					for _, x := range ms {
						s, _ := x.(string)
						q.Members = append(q.Members, s)
					}
				}
				q.Messages = -1 // unknown: a queue without a leader
				if f, ok := m["messages"].(float64); ok {
					q.Messages = int(f)
				}
				all = append(all, q)
			}
		}
		var out2 []QueueInfo
		for _, q := range all {
			if strings.HasPrefix(q.Name, prefix) {
				out2 = append(out2, q)
			}
		}
		return out2, nil
	}
	return nil, lastErr
}

// PGPair is the local PostgreSQL primary and streaming standby of
// scripts/pg-pair.sh: node "a" on 127.0.0.1:5441 (the primary at first) and
// node "b" on 127.0.0.1:5442 (its standby, application_name eo_standby), or
// on EO_PGPAIR_PORT_BASE+1 and +2.
type PGPair struct{}

func pgPairPort(n string) int {
	if n == "b" {
		return envInt("EO_PGPAIR_PORT_BASE", 5440) + 2
	}
	return envInt("EO_PGPAIR_PORT_BASE", 5440) + 1
}

// StartPGPair creates a fresh pair (removing any earlier one) and waits
// until the standby streams. Replication is asynchronous until
// SetReplication says otherwise.
func StartPGPair() (*PGPair, error) {
	if _, err := runScript(2*time.Minute, nil, "pg-pair.sh", "up"); err != nil {
		return nil, err
	}
	return &PGPair{}, nil
}

// Stop stops both nodes and removes their data.
func (p *PGPair) Stop() error {
	_, err := runScript(time.Minute, nil, "pg-pair.sh", "down")
	return err
}

// URL finds whichever node takes writes: both hosts, target_session_attrs=read-write.
func (p *PGPair) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d,127.0.0.1:%d/test?sslmode=disable&target_session_attrs=read-write", pgPairPort("a"), pgPairPort("b"))
}

// NodeURL is node n's own URL ("a" or "b"), whatever its role.
func (p *PGPair) NodeURL(n string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?sslmode=disable", pgPairPort(n))
}

// Crash stops node n as a crash does (pg_ctl stop -m immediate: no
// shutdown checkpoint, and its WAL senders send nothing more).
func (p *PGPair) Crash(n string) error {
	_, err := runScript(time.Minute, nil, "pg-pair.sh", "crash", n)
	return err
}

// Promote promotes standby n and returns once it takes writes.
func (p *PGPair) Promote(n string) error {
	_, err := runScript(time.Minute, nil, "pg-pair.sh", "promote", n)
	return err
}

// SetReplication sets how the primary (node primary) waits for the standby at
// COMMIT: "async" (synchronous_standby_names empty), or a synchronous_commit
// value with the standby named synchronous ("remote_apply", "on",
// "remote_write"). It returns once the primary's configuration is reloaded.
func (p *PGPair) SetReplication(ctx context.Context, primary, mode string) error {
	conn, err := pgx.Connect(ctx, p.NodeURL(primary))
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close(ctx) }()
	names, commit := "eo_standby", mode
	if mode == "async" {
		names, commit = "", "on"
	}
	for _, q := range []string{
		"ALTER SYSTEM SET synchronous_standby_names = '" + names + "'",
		"ALTER SYSTEM SET synchronous_commit = '" + commit + "'",
		"SELECT pg_reload_conf()",
	} {
		if _, err := conn.Exec(ctx, q); err != nil {
			return fmt.Errorf("%s: %w", q, err)
		}
	}
	// pg_reload_conf signals; wait until this server's sessions see it.
	deadline := time.Now().Add(10 * time.Second)
	for {
		var got string
		c2, err := pgx.Connect(ctx, p.NodeURL(primary))
		if err != nil {
			return err
		}
		err = c2.QueryRow(ctx, "SHOW synchronous_standby_names").Scan(&got)
		_ = c2.Close(ctx)
		if err != nil {
			return err
		}
		if got == names {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("synchronous_standby_names is %q, not %q, 10 s after the reload", got, names)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
