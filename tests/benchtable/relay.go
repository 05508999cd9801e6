package main

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/components/forwarder"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The relay section. Each backlog level has a schema of its own holding an
// outbox table (the library's) and a forwarder table (watermill-sql's
// default PostgreSQL schema, in the forwarder's envelope format), both
// pre-filled with the level's backlog in SQL. A round times one variant
// draining up to cfg.relayRows rows (or for cfg.relayTime) from its table
// into one durable queue; between rounds the table is topped up to the
// backlog again and the queue purged, outside the timing. All levels exist
// at once, so that every round visits every (level, variant) pair.
//
// With -engines mariadb, MariaDB has a level per backlog too (a database of
// its own, its outbox filled from a SEQUENCE table) drained by the relay
// through the confirm window, in the same rounds: the forwarder's storage
// and the watermill-amqp publisher are compared on PostgreSQL only.

type relayVariant string

const (
	relayWindow    relayVariant = "relay, confirm window"
	relayWatermill relayVariant = "relay, watermill-amqp"
	relayForwarder relayVariant = "forwarder"
)

var relayVariants = []relayVariant{relayWindow, relayWatermill, relayForwarder}

type relayLevel struct {
	engine   engine // zero: PostgreSQL
	backlog  int
	db       sqlschema.DB // Conn: the relay pool; Schema: the level's
	fwdPool  *pgxpool.Pool
	fwdTopic string // forwarder topic: table "watermill_<topic>" in the level's schema
	seq      int    // rows written to the outbox so far
	fseq     int    // rows written to the forwarder table so far
}

func (l *relayLevel) fwdTable() string {
	return pgx.Identifier{l.db.Schema, "watermill_" + l.fwdTopic}.Sanitize()
}

func (l *relayLevel) fwdOffsets() string {
	return pgx.Identifier{l.db.Schema, "watermill_offsets_" + l.fwdTopic}.Sanitize()
}

// name is the level in logs and CPU accounts: its backlog, and engine.
func (l *relayLevel) name() string { return short(l.backlog) + l.engine.suffix() }

// variants are the relay variants run on l's engine.
func (l *relayLevel) variants() []relayVariant {
	if l.engine.mysql() {
		return []relayVariant{relayWindow}
	}
	return relayVariants
}

type relayEnv struct {
	queue     string
	relayPool *pgxpool.Pool
	relayStd  *sql.DB               // MariaDB's relay connections
	traces    map[engine]*stmtTrace // -stmts
	window    *rabbitmq.Publisher
	wamqp     message.Publisher // the relay's watermill-amqp publisher
	fwdOut    message.Publisher // the forwarder's (watermill-amqp, same config)
}

// watermillAMQPPublisher is watermill-amqp's publisher as its docs configure
// it for reliable publishing: durable-queue topology, publisher confirms.
func watermillAMQPPublisher(amqpURL string) (message.Publisher, error) {
	c := wamqp.NewDurableQueueConfig(amqpURL)
	c.Publish.ConfirmDelivery = true
	return wamqp.NewPublisher(c, watermill.NopLogger{})
}

func (h *harness) relaySection(ctx context.Context) ([]*line, error) {
	cfg := h.cfg
	env := &relayEnv{traces: map[engine]*stmtTrace{}}
	var err error
	if env.queue, err = h.newQueue("relay"); err != nil {
		return nil, err
	}
	for _, e := range cfg.engines {
		if cfg.stmts {
			env.traces[e] = newStmtTrace()
		}
		c, err := h.openConn(ctx, e, cfg.relayWorkers+4, env.traces[e])
		if err != nil {
			return nil, err
		}
		defer c.close()
		if e.mysql() {
			env.relayStd = c.std
		} else {
			env.relayPool = c.pg
		}
	}
	if env.window, err = rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: cfg.amqpURL, Window: cfg.window}); err != nil {
		return nil, err
	}
	defer func() { _ = env.window.Close() }()
	if env.wamqp, err = watermillAMQPPublisher(cfg.amqpURL); err != nil {
		return nil, err
	}
	defer func() { _ = env.wamqp.Close() }()
	if env.fwdOut, err = watermillAMQPPublisher(cfg.amqpURL); err != nil {
		return nil, err
	}
	defer func() { _ = env.fwdOut.Close() }()

	// levels[e][i] is engine e's level of backlog cfg.backlogs[i].
	levels := map[engine][]*relayLevel{}
	var all []*relayLevel // in the order rounds visit them
	for _, b := range cfg.backlogs {
		for _, e := range cfg.engines {
			l, err := h.newRelayLevel(ctx, env, e, b)
			if err != nil {
				return nil, fmt.Errorf("backlog %s%s: %w", short(b), e.suffix(), err)
			}
			if l.fwdPool != nil {
				defer l.fwdPool.Close()
			}
			levels[e] = append(levels[e], l)
			all = append(all, l)
		}
	}

	rates := map[*relayLevel]map[relayVariant][]float64{}
	for _, l := range all {
		rates[l] = map[relayVariant][]float64{}
	}
	for r := range cfg.rounds {
		var parts []string
		for i := range all {
			l := all[(i+r)%len(all)]
			vs := l.variants()
			for j := range vs {
				v := vs[(j+r)%len(vs)]
				rate, rows, err := h.relayRound(ctx, env, l, v)
				if err != nil {
					return nil, fmt.Errorf("round %d, %s pending, %s: %w", r+1, l.name(), v, err)
				}
				rates[l][v] = append(rates[l][v], rate)
				parts = append(parts, fmt.Sprintf("%s@%s %s (%s rows)", v, l.name(), thousands(int64(rate)), thousands(int64(rows))))
			}
		}
		logf("relay round %d/%d (events/s): %s", r+1, cfg.rounds, strings.Join(parts, "; "))
	}
	return relayLines(cfg, levels, rates), nil
}

// relayLines are the section's lines: per backlog, PostgreSQL's variants
// and, with both engines, MariaDB's relay against PostgreSQL's; then the
// backlog's effect on each engine.
func relayLines(cfg *config, levels map[engine][]*relayLevel, rates map[*relayLevel]map[relayVariant][]float64) []*line {
	var lines []*line
	for i, b := range cfg.backlogs {
		where := fmt.Sprintf("%s pending rows", short(b))
		if pg := levels[postgres]; pg != nil {
			rr := rates[pg[i]]
			lines = append(lines,
				&line{name: where + postgres.suffix(), aName: "relay, confirm window", bName: "relay, watermill-amqp publisher", a: rr[relayWindow], b: rr[relayWatermill], unit: "events/s", target: "—"},
				&line{name: where + postgres.suffix(), aName: "relay, confirm window", bName: "Watermill forwarder", a: rr[relayWindow], b: rr[relayForwarder], unit: "events/s",
					target: "A ≥ 10,000 events/s, A/B ≥ 6", check: func(a, _, r float64) bool { return a >= 10_000 && r >= 6 }})
		}
		if my, pg := levels[mariadb], levels[postgres]; my != nil && pg != nil {
			lines = append(lines, &line{name: where + ", relay, confirm window: engine", aName: string(mariadb), bName: string(postgres),
				a: rates[my[i]][relayWindow], b: rates[pg[i]][relayWindow], unit: "events/s", target: "—"})
		}
	}
	if len(cfg.backlogs) > 1 {
		for _, e := range cfg.engines {
			ls := levels[e]
			small, large := ls[0], ls[len(ls)-1]
			lines = append(lines, &line{name: "relay, confirm window: backlog" + e.suffix(), aName: short(large.backlog) + " pending", bName: short(small.backlog) + " pending",
				a: rates[large][relayWindow], b: rates[small][relayWindow], unit: "events/s",
				target: "0.8 ≤ A/B ≤ 1.2", check: func(_, _, r float64) bool { return r >= 0.8 && r <= 1.2 }})
		}
	}
	return lines
}

func (h *harness) newRelayLevel(ctx context.Context, env *relayEnv, e engine, backlog int) (*relayLevel, error) {
	l := &relayLevel{engine: e, backlog: backlog}
	db, err := h.newSchemaOn(ctx, e, "relay_"+short(backlog))
	if err != nil {
		return nil, err
	}
	if e.mysql() {
		db.Conn = wsql.BeginnerFromStdSQL(env.relayStd)
		l.db = db
		start := time.Now()
		if err := h.fillOutbox(ctx, l, env.queue, backlog); err != nil {
			return nil, err
		}
		if err := h.adminConn(e).exec(ctx, mustSQL(e, "Analyze", sqlData{Table: db.Outbox()})); err != nil {
			return nil, err
		}
		logf("relay: %s rows pre-filled in the outbox in %s", l.name(), time.Since(start).Round(100*time.Millisecond))
		return l, nil
	}
	db.Conn = wsql.BeginnerFromPgx(env.relayPool)
	l.db, l.fwdTopic = db, "fwd_"+short(backlog)
	if l.fwdPool, err = newPool(ctx, h.cfg.dbURL, 4, db.Schema); err != nil {
		return nil, err
	}
	// watermill-sql creates the forwarder's tables itself, as in production.
	sub, err := newForwarderSubscriber(l.fwdPool)
	if err != nil {
		return nil, err
	}
	if err := sub.SubscribeInitialize(l.fwdTopic); err != nil {
		return nil, err
	}
	_ = sub.Close()
	start := time.Now()
	if err := h.fillOutbox(ctx, l, env.queue, backlog); err != nil {
		return nil, err
	}
	if err := h.fillForwarder(ctx, l, env.queue, backlog); err != nil {
		return nil, err
	}
	for _, t := range []string{db.Outbox(), l.fwdTable()} {
		if err := h.exec(ctx, "VACUUM ANALYZE "+t); err != nil {
			return nil, err
		}
	}
	logf("relay: %s rows pre-filled in the outbox and in the forwarder's table in %s", short(backlog), time.Since(start).Round(100*time.Millisecond))
	return l, nil
}

func newForwarderSubscriber(pool *pgxpool.Pool) (*wsql.Subscriber, error) {
	return wsql.NewSubscriber(wsql.BeginnerFromPgx(pool), wsql.SubscriberConfig{
		SchemaAdapter:    wsql.DefaultPostgreSQLSchema{},
		OffsetsAdapter:   wsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
	}, watermill.NopLogger{})
}

// fillOutbox appends n rows for queue to the level's outbox, in the columns
// outbox.Publisher writes (topic, uuid, payload, metadata; the rest default):
// one INSERT ... SELECT on PostgreSQL, one per 100,000 rows on MariaDB.
func (h *harness) fillOutbox(ctx context.Context, l *relayLevel, queue string, n int) error {
	if !l.engine.mysql() {
		err := h.exec(ctx, mustSQL(postgres, "FillOutbox", sqlData{Outbox: l.db.Outbox()}), queue, l.seq+1, l.seq+n)
		l.seq += n
		return err
	}
	const chunk = 100_000
	for done := 0; done < n; done += chunk {
		k := min(chunk, n-done)
		q := mustSQL(mariadb, "FillOutbox", sqlData{Outbox: l.db.Outbox(), From: l.seq + 1, To: l.seq + k})
		if _, err := h.myAdmin.ExecContext(ctx, q, queue); err != nil {
			return err
		}
		l.seq += k
	}
	return nil
}

// forwarderFillSQL appends rows from+1..to to a forwarder table, one row
// per transaction as a service writing one event per business transaction
// would (the forwarder orders by transaction id), each exactly what
// forwarder.Publisher over watermill-sql's publisher with the default
// PostgreSQL schema writes for a message with that payload and metadata
// published to queue (TestForwarderFillMatchesPublisher checks it).
func forwarderFillSQL(table, queue string, from, to int) string {
	return fmt.Sprintf(`DO $fill$
BEGIN
  PERFORM set_config('synchronous_commit', 'off', true);
  FOR g IN %d..%d LOOP
    INSERT INTO %s (uuid, payload, metadata, transaction_id)
    VALUES (gen_random_uuid()::text,
            ('{"destination_topic":"%s","uuid":"fwd-' || g || '","payload":"' ||
             encode(convert_to('{"n":' || g || '}', 'UTF8'), 'base64') ||
             '","metadata":{"source":"bench"}}')::json,
            '{}', pg_current_xact_id());
    COMMIT;
    PERFORM set_config('synchronous_commit', 'off', true);
  END LOOP;
END
$fill$`, from, to, table, queue)
}

func (h *harness) fillForwarder(ctx context.Context, l *relayLevel, queue string, n int) error {
	// A DO block with COMMITs must run outside a transaction block: the
	// simple protocol (no arguments) on a connection of its own.
	const chunk = 50_000
	for done := 0; done < n; done += chunk {
		k := min(chunk, n-done)
		if err := h.exec(ctx, forwarderFillSQL(l.fwdTable(), queue, l.fseq+1, l.fseq+k)); err != nil {
			return err
		}
		l.fseq += k
	}
	return nil
}

// pendingOutbox is the level's outbox backlog (relayed rows are deleted).
func (h *harness) pendingOutbox(ctx context.Context, l *relayLevel) (int, error) {
	n, err := h.adminConn(l.engine).count(ctx, mustSQL(l.engine, "Count", sqlData{Table: l.db.Outbox()}))
	return int(n), err
}

// pendingForwarder is the number of forwarder rows past the consumer
// group's acknowledged position (rows are never deleted).
func (h *harness) pendingForwarder(ctx context.Context, l *relayLevel) (int, error) {
	n, err := h.count(ctx, `SELECT count(*) FROM `+l.fwdTable()+` m
WHERE NOT EXISTS (SELECT 1 FROM `+l.fwdOffsets()+` o WHERE o.consumer_group = '')
   OR (m.transaction_id, m."offset") > (SELECT o.last_processed_transaction_id, o.offset_acked FROM `+l.fwdOffsets()+` o WHERE o.consumer_group = '')`)
	return int(n), err
}

// relayRound tops the variant's table up to the level's backlog, purges the
// queue, then times the variant draining min(backlog, relayRows) rows, or for
// relayTime, whichever ends first. It returns events/s and the rows timed.
func (h *harness) relayRound(ctx context.Context, env *relayEnv, l *relayLevel, v relayVariant) (float64, int, error) {
	if v == relayForwarder {
		p, err := h.pendingForwarder(ctx, l)
		if err != nil {
			return 0, 0, err
		}
		if p < l.backlog {
			if err := h.fillForwarder(ctx, l, env.queue, l.backlog-p); err != nil {
				return 0, 0, err
			}
		}
	} else {
		p, err := h.pendingOutbox(ctx, l)
		if err != nil {
			return 0, 0, err
		}
		if p < l.backlog {
			if err := h.fillOutbox(ctx, l, env.queue, l.backlog-p); err != nil {
				return 0, 0, err
			}
		}
	}
	if err := h.purge(env.queue); err != nil {
		return 0, 0, err
	}
	target := min(l.backlog, h.cfg.relayRows)

	var rows int
	var wall time.Duration
	err := h.timedTraced(fmt.Sprintf("%s @ %s", v, l.name()), env.traces[l.engine], func() (int, time.Duration, error) {
		var err error
		switch v {
		case relayForwarder:
			rows, wall, err = h.runForwarder(ctx, env, l, target)
		default:
			var pub message.Publisher = env.window
			if v == relayWatermill {
				pub = env.wamqp
			}
			rows, wall, err = h.runRelay(ctx, l, pub, target)
		}
		return rows, wall, err
	})
	if err != nil {
		return 0, 0, err
	}
	// What was counted must be in the queue (RabbitMQ drops silently what
	// no queue takes).
	if depth, err := h.depth(env.queue); err != nil {
		return 0, 0, err
	} else if depth < rows {
		return 0, 0, fmt.Errorf("%s: %d messages counted, but the queue holds %d", v, rows, depth)
	}
	return float64(rows) / wall.Seconds(), rows, nil
}

// until polls count every millisecond until it reaches target or limit
// passed, and returns the last count seen and when it was first seen (since
// start): a count that moves in steps (a relay counts a batch at its
// commit) is timed at the step, not at the poll that ended the wait.
func until(ctx context.Context, start time.Time, target int, limit time.Duration, count func() int) (int, time.Duration) {
	t := time.NewTicker(time.Millisecond)
	defer t.Stop()
	last, lastAt := 0, time.Duration(0)
	for {
		n := count()
		el := time.Since(start)
		if n != last {
			last, lastAt = n, el
		}
		if n >= target || el >= limit || ctx.Err() != nil {
			return last, lastAt
		}
		<-t.C
	}
}

func (h *harness) runRelay(ctx context.Context, l *relayLevel, pub message.Publisher, target int) (int, time.Duration, error) {
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		DB: l.db, Publisher: pub, Logger: watermill.NopLogger{},
		BatchSize: h.cfg.relayBatch, Workers: h.cfg.relayWorkers,
	})
	if err != nil {
		return 0, 0, err
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- relay.Run(rctx) }()
	n, el := until(ctx, start, target, h.cfg.relayTime, func() int { return int(relay.Stats().Relayed) })
	cancel()
	if err := <-done; err != nil {
		return 0, 0, err
	}
	if st := relay.Stats(); st.Failures > 0 {
		return 0, 0, fmt.Errorf("relay: %d failed batches, last: %w", st.Failures, st.LastError)
	}
	return n, el, nil
}

// countingPublisher counts the messages its publisher accepted.
type countingPublisher struct {
	message.Publisher
	n       atomic.Int64
	failed  atomic.Int64
	lastErr atomic.Value
}

func (c *countingPublisher) Publish(topic string, msgs ...*message.Message) error {
	err := c.Publisher.Publish(topic, msgs...)
	if err != nil {
		c.failed.Add(1)
		c.lastErr.Store(err.Error())
		return err
	}
	c.n.Add(int64(len(msgs)))
	return nil
}

func (c *countingPublisher) Close() error { return nil } // shared across rounds

// runForwarder runs the stock forwarder (its own router, watermill-sql's
// subscriber with the default PostgreSQL schema and offsets adapter,
// watermill-amqp's publisher with confirms) on the level's forwarder topic.
func (h *harness) runForwarder(ctx context.Context, env *relayEnv, l *relayLevel, target int) (int, time.Duration, error) {
	sub, err := newForwarderSubscriber(l.fwdPool)
	if err != nil {
		return 0, 0, err
	}
	defer func() { _ = sub.Close() }()
	out := &countingPublisher{Publisher: env.fwdOut}
	f, err := forwarder.NewForwarder(sub, out, watermill.NopLogger{}, forwarder.Config{ForwarderTopic: l.fwdTopic})
	if err != nil {
		return 0, 0, err
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	start := time.Now()
	go func() { done <- f.Run(rctx) }()
	n, el := until(ctx, start, target, h.cfg.relayTime, func() int { return int(out.n.Load()) })
	failedWhileTimed := out.failed.Load()
	cancel()
	if err := <-done; err != nil {
		return 0, 0, err
	}
	// A failed publish is nacked and redelivered by the forwarder: it costs
	// time, which the rate shows. Report it.
	if failedWhileTimed > 0 {
		logf("forwarder @ %s: %d publishes failed while timed (retried by the forwarder), last: %v", short(l.backlog), failedWhileTimed, out.lastErr.Load())
	} else if f := out.failed.Load(); f > 0 {
		logf("forwarder @ %s: %d publishes failed while stopping, last: %v", short(l.backlog), f, out.lastErr.Load())
	}
	return n, el, nil
}
