package chaos

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// orderedSettings size TestChaosOrdered. Environment:
//
//	CHAOS_ORDERED_KEYS     ordering keys (default 200)
//	CHAOS_ORDERED_PER_KEY  messages per key, sequence numbers 1..n (default 50)
//	CHAOS_ORDERED_MODES    the ordered runs, comma-separated: a consumer mode
//	                       among transactional, batch, lease, optionally on
//	                       MariaDB: mode@mariadb (its default REPEATABLE
//	                       READ) or mode@mariadb-rc (READ COMMITTED); and
//	                       transactional or batch on the three-node cluster:
//	                       mode+cluster (quorum partitions, the relays and
//	                       consumers on the package's Publisher and
//	                       Subscriber knowing the three nodes, the nodes
//	                       SIGKILLed: see cluster_test.go)
//	                       (default transactional,transactional@mariadb,
//	                       transactional+cluster; `make chaos`: the three
//	                       modes on each engine, both transactional ones on
//	                       the cluster)
//	CHAOS_CLUSTER_FAULTS   a cluster run's rounds of node kills and majorities
//	                       lost, each (default 1)
//
// A MariaDB or cluster run without CHAOS_ORDERED_KEYS and
// CHAOS_ORDERED_PER_KEY is smaller (orderedMariaDBKeys x
// orderedMariaDBPerKey, orderedClusterKeys x orderedClusterPerKey), for
// the short form's time.
type orderedSettings struct {
	keys, perKey  int
	sized         bool // CHAOS_ORDERED_KEYS or CHAOS_ORDERED_PER_KEY set
	runs          []orderedRun
	clusterFaults int
	// clusterFaultsSet: CHAOS_CLUSTER_FAULTS was given (full rounds; else
	// the compact schedule, see clusterChaos).
	clusterFaultsSet bool
}

// defaultOrderedRuns are the short form's ordered runs.
const defaultOrderedRuns = "transactional,transactional@mariadb,transactional+cluster"

// orderedRun is one ordered run: the consumers' mode, the database ("" for
// PostgreSQL, or dbMariaDB, dbMariaDBRC), and whether RabbitMQ is the
// three-node cluster.
type orderedRun struct {
	mode, db string
	cluster  bool
}

func (r orderedRun) String() string {
	s := r.mode
	if r.cluster {
		s += "+" + subCluster
	}
	if r.db == "" {
		return s
	}
	return s + "@" + r.db
}

func (r orderedRun) mysql() bool { return r.db != "" }

// The short form's size of a MariaDB ordered run.
const (
	orderedMariaDBKeys   = 100
	orderedMariaDBPerKey = 30
)

// The short form's size of a cluster ordered run: the node faults set its
// length.
const (
	orderedClusterKeys   = 60
	orderedClusterPerKey = 25
)

// orderedworkerConsumer is ./orderedworker's consumer name in the inbox.
const orderedworkerConsumer = "ordered-consumer"

const (
	orderedPartitions = 8
	orderedPoisonKeys = 5  // keys k000..k004 carry a message the broker refuses for good
	orderedPoisonSeq  = 20 // at this sequence number (or the last, with fewer)
	orderedWriters    = 8
)

func readOrderedSettings(t *testing.T) orderedSettings {
	s := orderedSettings{keys: 200, perKey: 50, clusterFaults: 1}
	var err error
	if v := os.Getenv("CHAOS_CLUSTER_FAULTS"); v != "" {
		s.clusterFaults, err = strconv.Atoi(v)
		require.NoError(t, err, "CHAOS_CLUSTER_FAULTS")
		require.Positive(t, s.clusterFaults, "CHAOS_CLUSTER_FAULTS")
		s.clusterFaultsSet = true
	}
	if v := os.Getenv("CHAOS_ORDERED_KEYS"); v != "" {
		s.keys, err = strconv.Atoi(v)
		require.NoError(t, err, "CHAOS_ORDERED_KEYS")
		s.sized = true
	}
	if v := os.Getenv("CHAOS_ORDERED_PER_KEY"); v != "" {
		s.perKey, err = strconv.Atoi(v)
		require.NoError(t, err, "CHAOS_ORDERED_PER_KEY")
		s.sized = true
	}
	require.Greater(t, s.keys, orderedPoisonKeys, "CHAOS_ORDERED_KEYS")
	require.GreaterOrEqual(t, s.perKey, 2, "CHAOS_ORDERED_PER_KEY")
	modes := defaultOrderedRuns
	if v := os.Getenv("CHAOS_ORDERED_MODES"); v != "" {
		modes = v
	}
	for item := range strings.SplitSeq(modes, ",") {
		mode, db, _ := strings.Cut(strings.TrimSpace(item), "@")
		mode, sub, _ := strings.Cut(mode, "+")
		require.Contains(t, []string{"transactional", "batch", "lease"}, mode, "CHAOS_ORDERED_MODES: %q", item)
		require.Contains(t, []string{"", dbMariaDB, dbMariaDBRC}, db, "CHAOS_ORDERED_MODES: %q: the database is PostgreSQL, @mariadb or @mariadb-rc", item)
		require.Contains(t, []string{"", subCluster}, sub, "CHAOS_ORDERED_MODES: %q: only +cluster may follow the mode", item)
		require.False(t, sub != "" && mode == "lease", "CHAOS_ORDERED_MODES: %q: the cluster runs are transactional or batch", item)
		s.runs = append(s.runs, orderedRun{mode: mode, db: db, cluster: sub == subCluster})
	}
	return s
}

// forRun is s sized for run: a MariaDB or cluster run is smaller unless the
// size was set.
func (s orderedSettings) forRun(run orderedRun) orderedSettings {
	switch {
	case s.sized:
	case run.cluster:
		s.keys, s.perKey = orderedClusterKeys, orderedClusterPerKey
	case run.mysql():
		s.keys, s.perKey = orderedMariaDBKeys, orderedMariaDBPerKey
	}
	return s
}

func (s orderedSettings) poisonSeq() int { return min(orderedPoisonSeq, s.perKey) }

// TestChaosOrdered: per-key order from the writing transactions to the
// consumer's effects, through RabbitMQ, under faults. Writers (concurrent
// transactions, each a few messages of random keys, a key's next sequence
// number taken under the row lock of its counter, as an application's
// aggregate row would be) write keys x perKey messages with their ordering
// key. Two relay processes (Workers 4 each) publish them to a topic of 8
// partition queues; two consumer processes (the middleware in the run's
// mode, a handler registered with rabbitmq.PartitionedSubscriber, single
// active consumer per partition) record each message's effect. During the
// run, the broker connections of the relays and of the consumers are cut,
// and each relay and each consumer is SIGKILLed and restarted. Five keys
// carry a message the broker refuses for good (a header name over 255
// bytes): the relay quarantines it and the key's later messages wait
// while every other key completes; then the operator discards it and the
// key completes.
//
// Invariants: for each key, the effects in the order they committed have
// strictly increasing sequence numbers, each exactly once, with no gap but
// the discarded message; the poisoned keys stop right before it until it is
// discarded; nothing is left in the outbox or the queues.
//
// The MariaDB runs (mode@mariadb, mode@mariadb-rc) are the same on the MySQL
// dialect: the writers' ordering keys serialised by the outbox's key-lock
// rows instead of advisory locks, the processes on go-sql-driver/mysql.
//
// The "unordered" subtest runs the same scenario without ordering keys,
// with one queue and competing subscriptions (exactlyonce.ConcurrentSubscriber),
// and shows that the order check fails there: exactly-once holds, order
// does not.
func TestChaosOrdered(t *testing.T) {
	s := readOrderedSettings(t)
	bin := buildBinary(t, "./orderedworker", "ordered-worker")
	for _, run := range s.runs {
		t.Run(run.String(), func(t *testing.T) { runOrdered(t, bin, s.forRun(run), run, true) })
	}
	t.Run("unordered", func(t *testing.T) { runOrdered(t, bin, s, orderedRun{mode: "transactional"}, false) })
}

func runOrdered(t *testing.T, bin string, s orderedSettings, run orderedRun, ordered bool) {
	mode := run.mode
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	my := run.mysql()
	// q picks the statement of the run's dialect.
	q := func(pg, mysql string) string {
		if my {
			return mysql
		}
		return pg
	}
	var db sqlschema.DB
	dbURL := testenv.DatabaseURL()
	if my {
		db = testenv.SchemaMySQL(t, wsql.BeginnerFromStdSQL(testenv.MySQLDB(t)))
		dbURL = orderedMySQLURL(t, db.Schema, run.db)
	} else {
		db = testenv.Schema(t)
	}
	tbl := func(name string) string { return db.Schema + "." + name }
	if my {
		tbl = func(name string) string { return db.Dialect.QuoteIdentifier(db.Schema, name) }
	}
	exec := func(q string, args ...any) {
		_, err := db.Conn.ExecContext(ctx, q, args...)
		require.NoError(t, err)
	}
	if my {
		exec(`CREATE TABLE ` + tbl("effects") + " (pos BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, `key` VARBINARY(16) NOT NULL, seq INT NOT NULL, " +
			"uuid VARBINARY(255) NOT NULL, worker VARCHAR(64) NOT NULL, KEY (`key`)) ENGINE = InnoDB")
		exec(`CREATE TABLE ` + tbl("counters") + ` (k VARBINARY(16) NOT NULL PRIMARY KEY, n INT NOT NULL) ENGINE = InnoDB`)
		exec(`INSERT INTO `+tbl("counters")+` (k, n) WITH RECURSIVE s(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM s WHERE i + 1 < ?)
SELECT CONCAT('k', LPAD(i, 3, '0')), 0 FROM s`, s.keys)
	} else {
		exec(`CREATE TABLE ` + tbl("effects") + ` (pos bigserial PRIMARY KEY, key text NOT NULL, seq int NOT NULL, uuid text NOT NULL, worker text NOT NULL)`)
		exec(`CREATE TABLE ` + tbl("counters") + ` (k text PRIMARY KEY, n int NOT NULL)`)
		exec(`INSERT INTO `+tbl("counters")+` SELECT 'k' || lpad(i::text, 3, '0'), 0 FROM generate_series(0, $1 - 1) i`, s.keys)
	}

	amqpURL := testenv.AMQPURL()
	topic := testenv.Unique(t, "ord_")
	partitions := 0
	queues := []string{topic}
	if ordered {
		partitions = orderedPartitions
		queues = queues[:0]
		for i := range partitions {
			queues = append(queues, rabbitmq.PartitionQueue(topic, i))
		}
	}
	var rc *testenv.RabbitCluster
	var admin *amqp.Connection
	switch {
	case run.cluster:
		// Quorum partitions, their leaders spread over the nodes.
		require.True(t, ordered, "the cluster runs are ordered")
		rc = rabbitCluster(t)
		clusterQueues(t, rc, queues, true)
		var err error
		admin, err = dialCluster(ctx, rc, 1)
		require.NoError(t, err)
		t.Cleanup(func() { _ = admin.Close() })
	case ordered:
		require.NoError(t, rabbitmq.DeclarePartitions(ctx, amqpURL, topic, partitions))
	default:
		require.NoError(t, rabbitmq.DeclareQueues(ctx, amqpURL, topic))
	}
	// adminConn is the harness's connection, again to a node that answers
	// when a node fault closed it.
	adminConn := func() *amqp.Connection {
		if run.cluster && admin.IsClosed() {
			conn, err := dialCluster(ctx, rc, 1)
			require.NoError(t, err)
			admin = conn
		}
		return admin
	}
	if !run.cluster {
		admin = testenv.AMQPConn(t)
		t.Cleanup(func() {
			ch, err := admin.Channel()
			if err != nil {
				return
			}
			for _, q := range queues {
				_, _ = ch.QueueDelete(q, false, false, false)
			}
		})
	}

	target := hostPort(t, amqpURL, "5672")
	relayProxy, consumerProxy := testenv.NewProxy(t, target), testenv.NewProxy(t, target)
	// The ways to the broker the "broker connections cut" fault cuts: the
	// two proxies, or on the cluster each process's proxies to the nodes
	// (links).
	cutters := []cutter{relayProxy, consumerProxy}
	links := func(env map[string]string, first int) *nodeLinks {
		l := newNodeLinks(t, rc)
		urls := l.urls(first)
		env["ORD_AMQP_URL"], env["ORD_AMQP_URLS"] = urls[0], strings.Join(urls[1:], ",")
		if run.cluster {
			cutters = append(cutters, l)
		}
		return l
	}
	if run.cluster {
		cutters = cutters[:0]
	}
	var relayLinks, consumerLinks []*nodeLinks
	logDir := t.TempDir()
	if os.Getenv("CHAOS_KEEP_LOGS") != "" {
		var err error
		logDir, err = os.MkdirTemp("", "chaos-ordered-*")
		require.NoError(t, err)
		t.Logf("worker logs kept in %s", logDir)
	}
	h := &harness{t: t, bin: bin, logDir: logDir}
	common := map[string]string{"ORD_DB_URL": dbURL, "ORD_SCHEMA": db.Schema, "ORD_TOPIC": topic,
		"ORD_PARTITIONS": strconv.Itoa(partitions)}
	if my {
		common["ORD_DRIVER"] = "mysql"
	}
	with := func(extra map[string]string) map[string]string {
		m := map[string]string{}
		for k, v := range common {
			m[k] = v
		}
		for k, v := range extra {
			m[k] = v
		}
		return m
	}
	var relays, consumers []*proc
	for i := range 2 {
		relayEnv := with(map[string]string{"ORD_ROLE": "relay", "ORD_WORKERS": "4", "ORD_AMQP_URL": relayProxy.RewriteURL(amqpURL)})
		consumerEnv := with(map[string]string{
			"ORD_ROLE": "consumer", "ORD_MODE": mode, "ORD_EFFECTS": tbl("effects"),
			"ORD_NAME": fmt.Sprintf("consumer%d", i), "ORD_AMQP_URL": consumerProxy.RewriteURL(amqpURL)})
		if run.cluster {
			// Relay i from node i+1 on, consumer i from node (i+2)%3+1:
			// the four processes start on different nodes.
			relayEnv["ORD_QUEUES"], consumerEnv["ORD_QUEUES"] = "quorum", "quorum"
			relayLinks = append(relayLinks, links(relayEnv, i+1))
			consumerLinks = append(consumerLinks, links(consumerEnv, (i+2)%3+1))
		}
		relays = append(relays, h.newProc(fmt.Sprintf("relay%d", i), relayEnv))
		consumers = append(consumers, h.newProc(fmt.Sprintf("consumer%d", i), consumerEnv))
	}
	all := append(append([]*proc{}, relays...), consumers...)
	for _, p := range all {
		p.start()
	}
	t.Cleanup(func() {
		for _, p := range all {
			p.stop()
		}
	})

	// The writers, paced so that the faults fall during the writing.
	start := time.Now()
	var writers sync.WaitGroup
	var deadlocks atomic.Int64 // writer transactions a deadlock rolled back
	writing := make(chan struct{})
	ob, err := outbox.NewWriter(db)
	require.NoError(t, err)
	// The writers pause 5 ms after each transaction; in a cluster run long
	// enough that the writing spans most of the node faults (~65 s per
	// CHAOS_CLUSTER_FAULTS: a round of restarts, a majority lost, the
	// other faults; ~45 s for the compact schedule), with 1 to 3 messages
	// per transaction.
	pause := 5 * time.Millisecond
	if run.cluster {
		planned := time.Duration(s.clusterFaults) * 65 * time.Second
		if !s.clusterFaultsSet {
			planned = 45 * time.Second
		}
		pause = max(pause, planned*orderedWriters*2/time.Duration(s.keys*s.perKey))
	}
	for w := range orderedWriters {
		writers.Go(func() { deadlocks.Add(orderedWriter(ctx, t, db, tbl("counters"), ob, s, topic, w, ordered, pause)) })
	}
	go func() { writers.Wait(); close(writing) }()

	// The faults, one after the other, each kind at least once, and on
	// until the writers are done.
	faults := map[string]int{}
	steps := []func(){
		func() { // the broker connections cut, for everyone
			for _, c := range cutters {
				c.Refuse()
			}
			time.Sleep(400 * time.Millisecond)
			for _, c := range cutters {
				c.Allow()
			}
			faults["broker connections cut"]++
		},
		func() {
			relays[0].kill()
			time.Sleep(300 * time.Millisecond)
			relays[0].start()
			faults["relay SIGKILLed"]++
		},
		func() {
			consumers[0].kill()
			time.Sleep(300 * time.Millisecond)
			consumers[0].start()
			faults["consumer SIGKILLed"]++
		},
		func() {
			relays[1].kill()
			time.Sleep(300 * time.Millisecond)
			relays[1].start()
			faults["relay SIGKILLed"]++
		},
		func() {
			consumers[1].kill()
			time.Sleep(300 * time.Millisecond)
			consumers[1].start()
			faults["consumer SIGKILLed"]++
		},
	}
	rounds := 1
	var cc *clusterChaos
	if run.cluster {
		// The nodes' faults among the others: a round of node kills (the
		// leader of the most partitions first, then relay0's node), a
		// majority lost (the node left alone changes each time).
		cc = &clusterChaos{t: t, c: rc, compact: !s.clusterFaultsSet, relays: relayLinks, consumers: consumerLinks,
			leader: func() int { return leaderByQueues(t, rc, topic) }}
		majorities := 0
		steps = append(steps[:2], append([]func(){func() { cc.round(ctx, 700*time.Millisecond) }}, steps[2:]...)...)
		steps = append(steps, func() {
			majorities++
			cc.majority(ctx, majorities%3+1)
		})
		rounds = s.clusterFaults
	}
	for i := 0; ; i++ {
		select {
		case <-writing:
			if i >= rounds*len(steps) {
				goto written
			}
		case <-time.After(700 * time.Millisecond):
		}
		steps[i%len(steps)]()
	}
written:
	wroteIn := time.Since(start)
	total := s.keys * s.perKey
	count := func(q string, args ...any) int64 { return testenv.Count(t, db.Conn, q, args...) }
	effects := func() int64 { return count(`SELECT count(*) FROM ` + tbl("effects")) }
	t.Logf("wrote %d messages in %s (%d writer transactions lost a deadlock); faults: %v", total, wroteIn.Round(time.Millisecond), deadlocks.Load(), faults)
	settle := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(3 * time.Minute)
		for !cond() {
			if time.Now().After(deadline) {
				t.Fatalf("not settled within 3 minutes: %s (effects %d of %d; unexpected exits %v)", what, effects(), total, h.exits)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	poisonSeq := s.poisonSeq()
	poisoned := func(k int) bool { return k < orderedPoisonKeys }
	quarantined := func() int64 {
		c, err := testenv.OutboxStore(t, db).Count(ctx, outbox.RowFilter{})
		require.NoError(t, err)
		return c
	}
	// healthyQuarantined: quarantined rows that are not poison (the
	// relays' MaxAttempts is 1: a failure of a healthy row taken for the
	// row's own would show here).
	// (One statement: the difference of two counts would see a poison row
	// quarantined between them as healthy.)
	healthyQuarantined := func() int64 {
		return count(q(`SELECT count(*) FROM `+db.Outbox()+` WHERE quarantined_at IS NOT NULL AND NOT (metadata ? 'poison')`,
			`SELECT count(*) FROM `+db.Outbox()+` WHERE quarantined_at IS NOT NULL AND NOT JSON_CONTAINS_PATH(metadata, 'one', '$.poison')`))
	}

	// Every poison row quarantined, every other key complete.
	settle("poison rows quarantined", func() bool {
		require.Zero(t, healthyQuarantined(), "healthy rows quarantined")
		return quarantined() == orderedPoisonKeys
	})
	if ordered {
		settle("the keys without poison complete", func() bool {
			return count(q(`SELECT count(*) FROM `+tbl("effects")+` WHERE key >= $1`, "SELECT count(*) FROM "+tbl("effects")+" WHERE `key` >= ?"),
				fmt.Sprintf("k%03d", orderedPoisonKeys)) ==
				int64((s.keys-orderedPoisonKeys)*s.perKey)
		})
		// A quarantined row holds back its key and nothing else: each
		// poisoned key stopped right before it, its later rows wait.
		time.Sleep(500 * time.Millisecond) // time for a wrongly released row to show
		for k := range orderedPoisonKeys {
			key := fmt.Sprintf("k%03d", k)
			require.Equal(t, int64(poisonSeq-1), count(q(`SELECT count(*) FROM `+tbl("effects")+` WHERE key = $1`,
				"SELECT count(*) FROM "+tbl("effects")+" WHERE `key` = ?"), key),
				"key %s: its messages after the quarantined one must wait", key)
		}
		require.Equal(t, int64(orderedPoisonKeys*(s.perKey-poisonSeq+1)), count(`SELECT count(*) FROM `+db.Outbox()),
			"the outbox holds the quarantined rows and the rows waiting behind them")
	}
	// The operator discards the poison rows.
	discarded, err := testenv.OutboxStore(t, db).DiscardMatching(ctx, outbox.RowFilter{Metadata: map[string]string{"poison": "1"}})
	require.NoError(t, err)
	require.Equal(t, int64(orderedPoisonKeys), discarded)
	want := int64(total - orderedPoisonKeys)
	settle("every message but the discarded ones has its effect", func() bool { return effects() >= want })
	settle("the outbox is empty", func() bool { return count(`SELECT count(*) FROM `+db.Outbox()) == 0 })
	settle("the queues are empty", func() bool {
		ch, err := adminConn().Channel()
		require.NoError(t, err)
		defer func() { _ = ch.Close() }()
		for _, q := range queues {
			qs, err := ch.QueueDeclarePassive(q, true, false, false, false, queueArgs(ordered))
			require.NoError(t, err)
			if qs.Messages > 0 {
				return false
			}
		}
		return true
	})
	time.Sleep(300 * time.Millisecond) // a late duplicate effect would show now
	settledIn := time.Since(start)

	// The invariants.
	rows, err := db.Conn.QueryContext(ctx, q(`SELECT key, seq FROM `+tbl("effects")+` ORDER BY pos`,
		"SELECT `key`, seq FROM "+tbl("effects")+" ORDER BY pos"))
	require.NoError(t, err)
	perKey := map[string][]int{}
	for rows.Next() {
		var key string
		var seq int
		require.NoError(t, rows.Scan(&key, &seq))
		perKey[key] = append(perKey[key], seq)
	}
	require.NoError(t, seam.Close(rows))
	var duplicates, missing, outOfOrder []string
	for k := range s.keys {
		key := fmt.Sprintf("k%03d", k)
		seen := map[int]int{}
		last := 0
		for _, seq := range perKey[key] {
			seen[seq]++
			if seq <= last && len(outOfOrder) < 10 {
				outOfOrder = append(outOfOrder, fmt.Sprintf("%s: %d after %d", key, seq, last))
			}
			last = max(last, seq)
		}
		for seq := 1; seq <= s.perKey; seq++ {
			skip := poisoned(k) && seq == poisonSeq
			switch {
			case skip && seen[seq] > 0:
				duplicates = append(duplicates, fmt.Sprintf("%s/%d: the discarded message has an effect", key, seq))
			case !skip && seen[seq] == 0:
				missing = append(missing, fmt.Sprintf("%s/%d", key, seq))
			case seen[seq] > 1:
				duplicates = append(duplicates, fmt.Sprintf("%s/%d x%d", key, seq, seen[seq]))
			}
		}
	}
	redeliveries := count(q(`SELECT coalesce(sum(duplicates), 0) FROM `+db.Inbox()+` WHERE consumer = $1`,
		`SELECT coalesce(sum(duplicates), 0) FROM `+db.Inbox()+` WHERE consumer = ?`), orderedworkerConsumer)
	t.Logf("%s (%s): %d effects of %d keys settled in %s; faults %v; out of order: %d shown %v; redeliveries of done messages (inbox duplicates) %d",
		map[bool]string{true: "ordered", false: "unordered"}[ordered], run, effects(), s.keys,
		settledIn.Round(time.Millisecond), faults, len(outOfOrder), outOfOrder, redeliveries)
	if cc != nil {
		counts := cc.counted()
		t.Logf("cluster faults: %v", counts)
		for _, k := range clusterKinds {
			require.GreaterOrEqual(t, counts[k], s.clusterFaults, "cluster fault %q", k)
		}
		per, all := cc.coverage()
		require.True(t, all, "every node SIGKILLed (%s)", per)
	}
	t.Logf("figures: run %s, messages %d, lost %d, duplicate effects %d, out of order %d, healthy rows quarantined %d, redeliveries %d, duration %s",
		run, total, len(missing), len(duplicates), len(outOfOrder), healthyQuarantined(), redeliveries, settledIn.Round(time.Second))
	require.Zero(t, healthyQuarantined(), "healthy rows quarantined")
	require.Empty(t, h.exits, "worker processes that exited on their own")
	require.Empty(t, missing, "messages without an effect (lost)")
	require.Empty(t, duplicates, "messages with more than one effect")
	require.Equal(t, want, effects())
	if ordered {
		require.Empty(t, outOfOrder, "effects of a key out of sequence order")
	} else {
		require.NotEmpty(t, outOfOrder, "the unordered setup is expected to break per-key order; the check saw none")
	}
}

// orderedMySQLURL is the mysql:// URL of the ordered run's processes: the
// run's database, and for @mariadb-rc sessions defaulting to READ COMMITTED.
func orderedMySQLURL(t *testing.T, database, db string) string {
	u, err := url.Parse(testenv.MySQLURL())
	require.NoError(t, err)
	u.Path = "/" + database
	if db == dbMariaDBRC {
		qs := u.Query()
		qs.Set("tx_isolation", "'READ-COMMITTED'")
		u.RawQuery = qs.Encode()
	}
	return u.String()
}

func queueArgs(ordered bool) amqp.Table {
	if ordered {
		return rabbitmq.PartitionQueueArguments()
	}
	return nil
}

// orderedWriter writes messages of random keys, one to three per
// transaction, each numbered after it was written with the key's next
// sequence number (its counter row, in the same transaction), until every
// counter is at s.perKey. A tenth of the transactions roll back; a deadlock between
// two writers (counters locked in opposite orders) rolls one back. Poisoned
// keys' message poisonSeq carries a header name RabbitMQ cannot take.
var errKeyFull = errors.New("the key has all its messages (test)")

// It returns the number of its transactions a deadlock rolled back.
func orderedWriter(ctx context.Context, t *testing.T, db sqlschema.DB, counters string, ob *outbox.Writer, s orderedSettings, topic string, w int, ordered bool, pause time.Duration) int64 {
	var deadlocks int64
	rng := mrand.New(mrand.NewPCG(uint64(w), 11))
	my := db.Dialect == sqlschema.MySQL
	q := func(pg, mysql string) string {
		if my {
			return mysql
		}
		return pg
	}
	badHeader := strings.Repeat("h", 300)
	writeTx := func() (int, error) {
		tx, err := db.Conn.BeginTx(ctx, nil)
		if err != nil {
			return 0, err
		}
		defer func() { _ = tx.Rollback() }()
		pub, err := ob.Publisher(tx)
		if err != nil {
			return 0, err
		}
		wrote := 0
		for range 1 + rng.IntN(3) {
			k := rng.IntN(s.keys)
			key := fmt.Sprintf("k%03d", k)
			if n, err := countIn(ctx, tx, q(`SELECT n FROM `+counters+` WHERE k = $1`, `SELECT n FROM `+counters+` WHERE k = ?`), key); err != nil {
				return 0, err
			} else if n >= s.perKey {
				continue
			}
			// The message first, its sequence number after: only the
			// ordering key's lock, which Publish takes, makes the writers
			// of a key wait for each other from before the row's id is
			// drawn until the commit (the counter's row lock, taken after,
			// would be too late for that).
			m := message.NewMessage(fmt.Sprintf("%s-%s-%d-%d", db.Schema, key, w, rng.Uint64()), nil)
			m.Metadata.Set("key", key)
			if ordered {
				msgid.SetOrderingKey(m, key)
			}
			if err := pub.Publish(topic, m); err != nil {
				return 0, err
			}
			var n int
			if my { // no RETURNING: the update, then a locking read of the row
				if _, err := tx.ExecContext(ctx, `UPDATE `+counters+` SET n = n + 1 WHERE k = ?`, key); err != nil {
					return 0, err
				}
			}
			rs, err := tx.QueryContext(ctx, q(`UPDATE `+counters+` SET n = n + 1 WHERE k = $1 RETURNING n`,
				`SELECT n FROM `+counters+` WHERE k = ? FOR UPDATE`), key)
			if err != nil {
				return 0, err
			}
			if rs.Next() {
				if err := rs.Scan(&n); err != nil {
					return 0, err
				}
			}
			if err := seam.Close(rs); err != nil { // a deadlock shows here
				return 0, err
			}
			if n > s.perKey {
				return 0, errKeyFull // another writer completed the key meanwhile: roll back
			}
			meta := map[string]string{"seq": strconv.Itoa(n)}
			if k < orderedPoisonKeys && n == s.poisonSeq() {
				meta["poison"] = "1"
				meta[badHeader] = "refused"
			}
			metaJSON, err := json.Marshal(meta)
			if err != nil {
				return 0, err
			}
			if my {
				// The row by its id: an UPDATE by uuid (no index of its
				// own) would lock every outbox row InnoDB scans, and
				// deadlock with the other writers and the relays. The
				// plain read sees the transaction's own row and locks
				// nothing.
				id, err := countIn(ctx, tx, `SELECT id FROM `+db.Outbox()+` WHERE quarantined_at IS NULL AND uuid = ?`, m.UUID)
				if err != nil {
					return 0, err
				}
				if id == 0 {
					return 0, fmt.Errorf("writer %d: the outbox row of %s is not visible to its own transaction", w, m.UUID)
				}
				if _, err := tx.ExecContext(ctx, `UPDATE `+db.Outbox()+` SET metadata = JSON_MERGE_PATCH(metadata, ?), payload = CAST(? AS BINARY) WHERE id = ?`,
					string(metaJSON), strconv.Itoa(n), id); err != nil {
					return 0, err
				}
			} else if _, err := tx.ExecContext(ctx, `UPDATE `+db.Outbox()+` SET metadata = metadata || $1::jsonb, payload = convert_to($2, 'UTF8') WHERE uuid = $3`,
				string(metaJSON), strconv.Itoa(n), m.UUID); err != nil {
				return 0, err
			}
			wrote++
		}
		if rng.IntN(10) == 0 {
			return 0, tx.Rollback()
		}
		return wrote, tx.Commit()
	}
	// Paced (a pause after each transaction: 5 ms, so that 10,000 messages
	// take ten seconds or more, or longer in a cluster run), so that the
	// faults fall among them.
	for ctx.Err() == nil {
		wrote, err := writeTx()
		// A deadlock: PostgreSQL's "deadlock detected", MySQL's "Deadlock
		// found" (1213).
		deadlock := err != nil && strings.Contains(strings.ToLower(err.Error()), "deadlock")
		if deadlock {
			deadlocks++
		}
		if err != nil && !errors.Is(err, errKeyFull) && !deadlock {
			t.Errorf("writer %d: %v", w, err)
			return deadlocks
		}
		if wrote == 0 && testenv.Count(t, db.Conn, q(`SELECT count(*) FROM `+counters+` WHERE n < $1`, `SELECT count(*) FROM `+counters+` WHERE n < ?`), s.perKey) == 0 {
			return deadlocks
		}
		if wrote == 0 {
			// Only full keys drawn: the pause is for messages written (the
			// last keys are drawn rarely; a long pause here would stretch
			// the end of the writing).
			time.Sleep(5 * time.Millisecond)
			continue
		}
		time.Sleep(pause)
	}
	return deadlocks
}

// countIn reads one integer through tx (0 when no row).
func countIn(ctx context.Context, tx wsql.Tx, q string, args ...any) (int, error) {
	rs, err := tx.QueryContext(ctx, q, args...)
	if err != nil {
		return 0, err
	}
	n := 0
	if rs.Next() {
		if err := rs.Scan(&n); err != nil {
			_ = rs.Close()
			return 0, err
		}
	}
	return n, seam.Close(rs)
}
