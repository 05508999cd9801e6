package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The rss section: the peak RSS (VmHWM) of a relay process and of a
// consuming service, each this binary re-executed with -child, at a small
// and a large backlog. Each process handles the same number of messages
// (cfg.rssMessages) whatever the backlog, so that only the backlog differs:
// with the large backlog it takes them from the front of the backlog (which
// is topped up again between rounds); with a backlog smaller than that, the
// parent keeps feeding the backlog (rows or messages) as the child reports
// its progress, so that it stays near its size until the end.

const (
	childRelay    = "relay"
	childConsumer = "consumer"
)

func (h *harness) rssSection(ctx context.Context) ([]*line, error) {
	cfg := h.cfg
	backlogs := cfg.rssBacklogs
	large := backlogs[len(backlogs)-1]

	// Relay: an outbox per backlog, one destination queue.
	relayQueue, err := h.newQueue("rss_relay")
	if err != nil {
		return nil, err
	}
	relayLevels := map[int]*relayLevel{}
	for _, b := range backlogs {
		db, err := h.newSchema(ctx, "rss_relay_"+short(b))
		if err != nil {
			return nil, err
		}
		relayLevels[b] = &relayLevel{backlog: b, db: db}
	}
	// Consumer: a queue per backlog, one schema (inbox and business table,
	// emptied between rounds).
	cdb, err := h.newSchema(ctx, "rss_consumer")
	if err != nil {
		return nil, err
	}
	cenv, err := newRouterEnv(ctx, cfg, cdb)
	if err != nil {
		return nil, err
	}
	cenv.pool.Close() // the child has its own; the table exists now
	consumerQueues := map[int]string{}
	for _, b := range backlogs {
		if consumerQueues[b], err = h.newQueue("rss_consumer_" + short(b)); err != nil {
			return nil, err
		}
	}
	start := time.Now()
	published := map[int]int{}
	for _, b := range backlogs {
		if b >= cfg.rssMessages {
			if err := h.fillOutbox(ctx, relayLevels[b], relayQueue, b); err != nil {
				return nil, err
			}
			if err := h.exec(ctx, "VACUUM ANALYZE "+relayLevels[b].db.Outbox()); err != nil {
				return nil, err
			}
			if err := publishParallel(ctx, h.amqp, consumerQueues[b], "rss"+short(b)+"-", 0, b); err != nil {
				return nil, err
			}
			published[b] = b
		}
	}
	logf("rss: backlogs pre-filled in %s", time.Since(start).Round(100*time.Millisecond))

	peak := map[string]map[int][]float64{childRelay: {}, childConsumer: {}}
	for r := range cfg.rounds {
		order := slices.Clone(backlogs)
		if r%2 == 1 {
			slices.Reverse(order)
		}
		var parts []string
		for _, b := range order {
			mib, rate, err := h.rssRelayRound(ctx, relayLevels[b], relayQueue)
			if err != nil {
				return nil, fmt.Errorf("round %d, relay at %s: %w", r+1, short(b), err)
			}
			peak[childRelay][b] = append(peak[childRelay][b], mib)
			parts = append(parts, fmt.Sprintf("relay@%s %.1f MiB (%s events/s)", short(b), mib, thousands(int64(rate))))
		}
		for _, b := range order {
			mib, rate, err := h.rssConsumerRound(ctx, cenv, consumerQueues[b], b, r, published)
			if err != nil {
				return nil, fmt.Errorf("round %d, consumer at %s: %w", r+1, short(b), err)
			}
			peak[childConsumer][b] = append(peak[childConsumer][b], mib)
			parts = append(parts, fmt.Sprintf("consumer@%s %.1f MiB (%s msg/s)", short(b), mib, thousands(int64(rate))))
		}
		logf("rss round %d/%d: %s", r+1, cfg.rounds, strings.Join(parts, ", "))
	}
	independent := func(_, _, r float64) bool { return r <= 1.2 }
	var lines []*line
	for _, kind := range []string{childRelay, childConsumer} {
		name := fmt.Sprintf("peak RSS, relay process (%s events each)", short(cfg.rssMessages))
		if kind == childConsumer {
			name = fmt.Sprintf("peak RSS, consuming service (group commit + Queue, %s msgs each)", short(cfg.rssMessages))
		}
		for _, small := range backlogs[:len(backlogs)-1] {
			lines = append(lines, &line{name: name, aName: short(large) + " backlog", bName: short(small) + " backlog",
				a: peak[kind][large], b: peak[kind][small], unit: "MiB", target: "A/B ≤ 1.2", check: independent})
		}
	}
	return lines, nil
}

// rssRelayRound runs a relay process on the level's outbox until it
// relayed cfg.rssMessages rows, feeding the outbox if the backlog is smaller.
func (h *harness) rssRelayRound(ctx context.Context, l *relayLevel, queue string) (float64, float64, error) {
	n := h.cfg.rssMessages
	feed := l.backlog < n
	if feed {
		if err := h.exec(ctx, "TRUNCATE "+l.db.Outbox()); err != nil {
			return 0, 0, err
		}
		if err := h.fillOutbox(ctx, l, queue, l.backlog); err != nil {
			return 0, 0, err
		}
	} else if p, err := h.pendingOutbox(ctx, l); err != nil {
		return 0, 0, err
	} else if p < l.backlog {
		if err := h.fillOutbox(ctx, l, queue, l.backlog-p); err != nil {
			return 0, 0, err
		}
	}
	if err := h.purge(queue); err != nil {
		return 0, 0, err
	}
	var feeder func(ctx context.Context, progress *atomic.Int64) error
	if feed {
		feeder = func(ctx context.Context, progress *atomic.Int64) error {
			inserted := l.backlog
			chunk := max(l.backlog/4, 1)
			for inserted < n+l.backlog {
				if inserted-int(progress.Load()) < l.backlog-chunk {
					k := min(chunk, n+l.backlog-inserted)
					if err := h.fillOutbox(ctx, l, queue, k); err != nil {
						return err
					}
					inserted += k
					continue
				}
				select {
				case <-ctx.Done():
					return nil
				case <-time.After(time.Millisecond):
				}
			}
			return nil
		}
	}
	return h.runChild(ctx, childRelay, l.db.Schema, queue, feeder)
}

// rssConsumerRound runs a consuming service on queue until it processed
// cfg.rssMessages messages, feeding the queue if the backlog is smaller.
func (h *harness) rssConsumerRound(ctx context.Context, e *routerEnv, queue string, backlog, round int, published map[int]int) (float64, float64, error) {
	n := h.cfg.rssMessages
	if err := h.exec(ctx, "TRUNCATE "+e.business+", "+e.db.Inbox()); err != nil {
		return 0, 0, err
	}
	feed := backlog < n
	var feeder func(ctx context.Context, progress *atomic.Int64) error
	if feed {
		if err := h.purge(queue); err != nil {
			return 0, 0, err
		}
		prefix := fmt.Sprintf("rss%s-%d-", short(backlog), round)
		if err := publishN(ctx, h.amqp, queue, prefix, 0, backlog); err != nil {
			return 0, 0, err
		}
		feeder = func(ctx context.Context, progress *atomic.Int64) error {
			sent := backlog
			chunk := max(backlog/4, 1)
			for sent < n+backlog {
				if sent-int(progress.Load()) < backlog-chunk {
					k := min(chunk, n+backlog-sent)
					if err := publishN(ctx, h.amqp, queue, prefix, sent, k); err != nil {
						return err
					}
					sent += k
					continue
				}
				select {
				case <-ctx.Done():
					return nil
				case <-time.After(time.Millisecond):
				}
			}
			return nil
		}
	} else if depth, err := h.depth(queue); err != nil {
		return 0, 0, err
	} else if depth < backlog {
		k := backlog - depth
		if err := publishParallel(ctx, h.amqp, queue, "rss"+short(backlog)+"-", published[backlog], k); err != nil {
			return 0, 0, err
		}
		published[backlog] += k
	}
	mib, rate, err := h.runChild(ctx, childConsumer, e.db.Schema, queue, feeder)
	if err != nil {
		return 0, 0, err
	}
	if feed {
		err = h.purge(queue)
	}
	return mib, rate, err
}

// runChild starts this binary as a child of kind, feeds it with feeder
// (if any) as it reports progress, reads its VmHWM once it says it is done,
// then lets it exit. It returns the peak RSS in MiB and the child's rate.
func (h *harness) runChild(ctx context.Context, kind, schema, queue string, feeder func(context.Context, *atomic.Int64) error) (float64, float64, error) {
	exe, err := os.Executable()
	if err != nil {
		return 0, 0, err
	}
	c := h.cfg
	cmd := exec.CommandContext(ctx, exe, "-child", kind, "-child-schema", schema, "-child-queue", queue,
		"-child-count", strconv.Itoa(c.rssMessages),
		"-relay-batch", strconv.Itoa(c.relayBatch), "-relay-workers", strconv.Itoa(c.relayWorkers), "-window", strconv.Itoa(c.window),
		"-pool", strconv.Itoa(c.pool), "-inflight", strconv.Itoa(c.inflight), "-prefetch", strconv.Itoa(c.prefetch))
	cmd.Env = append(os.Environ(), "DATABASE_URL="+c.dbURL, "AMQP_URL="+c.amqpURL)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return 0, 0, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return 0, 0, err
	}
	if err := cmd.Start(); err != nil {
		return 0, 0, err
	}
	defer func() { _ = stdin.Close(); _ = cmd.Wait() }()

	var progress atomic.Int64
	done := make(chan [2]float64, 1)
	readErr := make(chan error, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			switch {
			case len(f) == 2 && f[0] == "progress":
				n, _ := strconv.ParseInt(f[1], 10, 64)
				progress.Store(n)
			case len(f) == 3 && f[0] == "done":
				n, _ := strconv.ParseFloat(f[1], 64)
				ns, _ := strconv.ParseFloat(f[2], 64)
				done <- [2]float64{n, ns}
			}
		}
		readErr <- errors.New("child exited before it was done")
	}()
	fctx, fcancel := context.WithCancel(ctx)
	defer fcancel()
	feedErr := make(chan error, 1)
	if feeder != nil {
		go func() { feedErr <- feeder(fctx, &progress) }()
	}
	select {
	case d := <-done:
		fcancel()
		mib, err := vmHWM(cmd.Process.Pid)
		if err != nil {
			return 0, 0, err
		}
		if feeder != nil {
			if err := <-feedErr; err != nil && !errors.Is(err, context.Canceled) {
				return 0, 0, fmt.Errorf("feeding the %s: %w", kind, err)
			}
		}
		_ = stdin.Close()
		if err := cmd.Wait(); err != nil {
			return 0, 0, fmt.Errorf("%s child: %w", kind, err)
		}
		return mib, d[0] / (d[1] / 1e9), nil
	case err := <-feedErr:
		if err == nil {
			err = <-readErr
		}
		return 0, 0, fmt.Errorf("feeding the %s: %w", kind, err)
	case err := <-readErr:
		return 0, 0, fmt.Errorf("%s: %w", kind, err)
	case <-time.After(15 * time.Minute):
		return 0, 0, fmt.Errorf("%s child not done within 15 minutes", kind)
	}
}

// runChild is the child's side: relay or consume cfg.child.count messages,
// printing "progress <n>" every 10ms and "done <n> <ns>" at the end, then
// wait for the parent to close stdin (it reads VmHWM meanwhile).
func runChild(ctx context.Context, cfg *config) error {
	var (
		count    func() int64
		finished = make(chan error, 1)
		stop     func()
		start    = time.Now()
		n        = int64(cfg.child.count)
	)
	switch cfg.child.kind {
	case childRelay:
		pool, err := newPool(ctx, cfg.dbURL, cfg.relayWorkers+2, "")
		if err != nil {
			return err
		}
		defer pool.Close()
		pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: cfg.amqpURL, Window: cfg.window})
		if err != nil {
			return err
		}
		defer func() { _ = pub.Close() }()
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB:        sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: cfg.child.schema},
			Publisher: pub, Logger: watermill.NopLogger{},
			BatchSize: cfg.relayBatch, Workers: cfg.relayWorkers,
		})
		if err != nil {
			return err
		}
		rctx, cancel := context.WithCancel(ctx)
		stop = cancel
		count = func() int64 { return relay.Stats().Relayed }
		go func() { finished <- relay.Run(rctx) }()
	case childConsumer:
		db := sqlschema.DB{Schema: cfg.child.schema}.WithDefaults()
		e, err := newRouterEnv(ctx, cfg, db)
		if err != nil {
			return err
		}
		defer e.pool.Close()
		h, err := e.handler(groupCommitExec)
		if err != nil {
			return err
		}
		d := newDrain(int(n))
		count = func() int64 { return d.ok.Load() }
		rctx, cancel := context.WithCancel(ctx)
		stop = cancel
		go func() {
			finished <- runRouter(rctx, cfg.amqpURL, cfg.child.queue, cfg.inflight, cfg.prefetch, d, h, 15*time.Minute)
		}()
	default:
		return fmt.Errorf("unknown -child %q", cfg.child.kind)
	}
	out := bufio.NewWriter(os.Stdout)
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		c := count()
		fmt.Fprintf(out, "progress %d\n", c)
		if c >= n {
			el := time.Since(start)
			stop()
			if err := <-finished; err != nil && !errors.Is(err, context.Canceled) {
				return err
			}
			fmt.Fprintf(out, "done %d %d\n", c, el.Nanoseconds())
			_ = out.Flush()
			_, _ = io.Copy(io.Discard, os.Stdin) // until the parent read VmHWM
			return nil
		}
		_ = out.Flush()
		select {
		case err := <-finished:
			if err == nil {
				err = errors.New("stopped before it was done")
			}
			return err
		case <-ctx.Done():
			stop()
			return ctx.Err()
		case <-t.C:
		}
	}
}
