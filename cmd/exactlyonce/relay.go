package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/spf13/cobra"

	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// relayOptions are the flags of `outbox relay`.
type relayOptions struct {
	amqpURL        string
	queueType      string
	publisher      string
	window         int
	noQueueDeclare bool
	partitions     map[string]int

	batchSize       int
	workers         int
	pollInterval    time.Duration
	maxAttempts     int
	errorBackoff    time.Duration
	maxErrorBackoff time.Duration
	listenURL       string
	noListen        bool

	once           bool
	reportInterval time.Duration
	logLevel       string
}

func (a *app) relayCmd() *cobra.Command {
	var o relayOptions
	def := outbox.RelayConfig{}.WithDefaults()
	cmd := &cobra.Command{
		Use:   "relay",
		Short: "Run the outbox relay: publish outbox rows to RabbitMQ until SIGINT/SIGTERM (or, with --once, until none is ready)",
		Long: `Run the outbox relay standalone: lock a batch of outbox rows, publish them with publisher
confirms, delete the confirmed ones, and again. Several relays (this command, or Relay.Run in your
services) may run against one table at once.

RabbitMQ (--publisher rabbitmq, the default): each row goes to the default exchange with its
topic as routing key, i.e. to the queue named like the topic, which is declared durable the first
time a topic is seen (--no-queue-declare when your queues are declared elsewhere). A topic given
with --topic-partitions topic=n is partitioned: each message goes to the queue <topic>.p<i> of its
ordering key, declared with single active consumer (per-key order, docs/ordering.md). The broker is
--amqp-url or $AMQP_URL: the nodes of a cluster separated by commas, tried in turn. --queue-type
quorum declares quorum queues (docs/clusters.md). A broker that is down is retried with backoff; the
relay starts anyway.

It runs until SIGINT or SIGTERM, then lets the batches in flight finish (what the broker confirmed
is deleted) and exits 0; a second signal exits at once. With --once it relays until no row is ready
(rows in backoff and quarantined rows are not), prints what it did and exits: 0 when every publish
succeeded, 1 when some failed. Logs go to standard error (slog; JSON with --json).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.relay(cmd, o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.amqpURL, "amqp-url", "", "RabbitMQ URL, amqp://user:password@host:5672/vhost, or the nodes of a cluster separated by commas (default $"+envAMQPURL+")")
	f.StringVar(&o.queueType, "queue-type", "classic", "rabbitmq: the type of the queues declared: classic or quorum (docs/clusters.md)")
	f.StringVar(&o.publisher, "publisher", "rabbitmq", "where rows go: rabbitmq")
	f.IntVar(&o.window, "window", 256, "rabbitmq: most messages of a batch awaiting their publisher confirm at once")
	f.BoolVar(&o.noQueueDeclare, "no-queue-declare", false, "rabbitmq: do not declare each topic's durable queue")
	f.StringToIntVar(&o.partitions, "topic-partitions", nil, "rabbitmq: partitioned topics, topic=n (repeatable): a message goes to queue <topic>.p<i> of its ordering key (docs/ordering.md)")
	f.IntVar(&o.batchSize, "batch-size", def.BatchSize, "rows locked, published and deleted per transaction (1..10000)")
	f.IntVar(&o.workers, "workers", def.Workers, "batches relayed concurrently")
	f.DurationVar(&o.pollInterval, "poll-interval", def.PollInterval, "wait after a poll that found less than a full batch (the fallback of wake-on-commit)")
	f.StringVar(&o.listenURL, "listen-url", os.Getenv("EXACTLYONCE_LISTEN_URL"), "direct PostgreSQL address for the wake-on-commit LISTEN, when --database-url goes through PgBouncer in transaction mode ($EXACTLYONCE_LISTEN_URL)")
	f.BoolVar(&o.noListen, "no-listen", false, "no wake-on-commit: only poll")
	f.IntVar(&o.maxAttempts, "max-attempts", def.MaxAttempts, "permanent failures (the broker refused the message itself) before a row is quarantined; other failures never quarantine")
	f.DurationVar(&o.errorBackoff, "error-backoff", def.ErrorBackoff, "first pause of a topic the broker is not taking, and first wait after a database failure; also paces a failing row's retries")
	f.DurationVar(&o.maxErrorBackoff, "max-error-backoff", def.MaxErrorBackoff, "cap of --error-backoff's doubling")
	f.BoolVar(&o.once, "once", false, "relay until no row is ready, then exit (for scripts)")
	f.DurationVar(&o.reportInterval, "report-interval", time.Minute, "log the counters this often while running (0: never)")
	f.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn or error")
	return cmd
}

func (o relayOptions) validate() error {
	switch {
	case o.publisher != "rabbitmq":
		return usageErr("--publisher %q: the publishers this command knows are: rabbitmq", o.publisher)
	case checkQueueType(o.queueType) != nil:
		return checkQueueType(o.queueType)
	case o.window < 1:
		return usageErr("--window must be at least 1")
	case o.batchSize < 1 || o.batchSize > 10000:
		return usageErr("--batch-size must be 1..10000")
	case o.workers < 1 || o.workers > 64:
		return usageErr("--workers must be 1..64")
	case o.pollInterval <= 0 || o.errorBackoff <= 0 || o.maxErrorBackoff <= 0:
		return usageErr("--poll-interval, --error-backoff and --max-error-backoff must be positive")
	case o.maxAttempts < 1:
		return usageErr("--max-attempts must be at least 1")
	case o.reportInterval < 0:
		return usageErr("--report-interval must not be negative")
	}
	return nil
}

func (a *app) logger(level string) (*slog.Logger, error) {
	var l slog.Level
	if err := l.UnmarshalText([]byte(level)); err != nil {
		return nil, usageErr("--log-level %q: want debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: l}
	if a.jsonOut {
		return slog.New(slog.NewJSONHandler(a.stderr, opts)), nil
	}
	return slog.New(slog.NewTextHandler(a.stderr, opts)), nil
}

// publisher builds the publisher the rows go to.
func (a *app) publisher(cmd *cobra.Command, o relayOptions) (message.Publisher, error) {
	url := flagOrEnv(cmd.Flags(), "amqp-url", o.amqpURL, envAMQPURL)
	if url == "" {
		return nil, usageErr("no broker: set %s or --amqp-url", envAMQPURL)
	}
	cfg := brokerConfig(url, o.queueType, o.partitions)
	cfg.Window, cfg.NoQueueDeclare = o.window, o.noQueueDeclare
	pub, err := rabbitmq.NewPublisher(cfg)
	if err != nil {
		return nil, usageErr("%v", err)
	}
	return pub, nil
}

// brokerConfig is the PublisherConfig of --amqp-url (one URL, or a
// cluster's nodes separated by commas), --queue-type and
// --topic-partitions, shared by the commands that publish.
func brokerConfig(urlList, queueType string, partitions map[string]int) rabbitmq.PublisherConfig {
	var urls []string
	for _, u := range strings.Split(urlList, ",") {
		if u = strings.TrimSpace(u); u != "" {
			urls = append(urls, u)
		}
	}
	return rabbitmq.PublisherConfig{URLs: urls, Partitions: partitions, Queues: rabbitmq.Queues{Type: rabbitmq.QueueType(queueType)}}
}

// checkQueueType refuses a --queue-type this command does not know.
func checkQueueType(t string) error {
	if t != string(rabbitmq.Classic) && t != string(rabbitmq.Quorum) {
		return usageErr("--queue-type %q: want classic or quorum", t)
	}
	return nil
}

// relayConfig is the RelayConfig of the flags. (Options added to
// RelayConfig later get their flags in relayCmd and their field here.)
func relayConfig(o relayOptions, db sqlschema.DB, pub message.Publisher, log *slog.Logger) outbox.RelayConfig {
	return outbox.RelayConfig{
		DB:               db,
		Publisher:        pub,
		BatchSize:        o.batchSize,
		Workers:          o.workers,
		PollInterval:     o.pollInterval,
		MaxAttempts:      o.maxAttempts,
		ErrorBackoff:     o.errorBackoff,
		MaxErrorBackoff:  o.maxErrorBackoff,
		ListenConnString: o.listenURL,
		NoListen:         o.noListen,
		Logger:           watermill.NewSlogLogger(log),
	}
}

func (a *app) relay(cmd *cobra.Command, o relayOptions) error {
	if err := o.validate(); err != nil {
		return err
	}
	log, err := a.logger(o.logLevel)
	if err != nil {
		return err
	}
	// The relay runs until a signal; --once until done, or --timeout when
	// given.
	ctx, cancel := a.opContext(cmd, true)
	defer cancel()
	pub, err := a.publisher(cmd, o)
	if err != nil {
		return err
	}
	defer func() { _ = pub.Close() }()
	names, err := a.names(cmd)
	if err != nil {
		return err
	}
	if names.Dialect == sqlschema.MySQL && o.listenURL != "" {
		return usageErr("--listen-url (or $EXACTLYONCE_LISTEN_URL) is PostgreSQL's LISTEN address, for PgBouncer in transaction mode: MySQL/MariaDB has no LISTEN (the relay polls, --poll-interval): leave it empty")
	}
	db, closeDB, err := a.open(ctx, cmd, int32(o.workers)+2, true)
	if err != nil {
		return err
	}
	defer closeDB()
	relay, err := outbox.NewRelay(relayConfig(o, db, pub, log))
	if err != nil {
		return usageErr("%v", err)
	}

	start := time.Now()
	log.Info("outbox relay started", "schema", db.Schema, "table", db.OutboxTable, "publisher", o.publisher,
		"batch_size", o.batchSize, "workers", o.workers, "once", o.once)
	stopReports := a.reportEvery(ctx, log, relay, o.reportInterval)
	if o.once {
		relayUntilIdle(ctx, log, relay, o.workers)
	} else {
		ran, stopping := make(chan struct{}), make(chan struct{})
		go func() {
			defer close(stopping)
			select {
			case <-ctx.Done():
				a.stopSignals() // a second signal ends the process at once
				log.Info("outbox relay stopping: finishing the batches in flight (signal again to exit at once)")
			case <-ran:
			}
		}()
		_ = relay.Run(ctx) // always nil: errors are logged
		close(ran)
		<-stopping
	}
	stopReports()
	st := relay.Stats()
	log.Info("outbox relay stopped", "relayed", st.Relayed, "batches", st.Batches,
		"failed_publishes", st.FailedPublishes, "quarantined", st.Quarantined)

	// The backlog left, on a context of its own: ctx may have ended.
	pctx, pcancel := context.WithTimeout(context.Background(), a.connectTimeout+5*time.Second)
	defer pcancel()
	left, perr := pendingOf(pctx, db)
	if err := a.printRelaySummary(st, time.Since(start), left, perr); err != nil {
		return err
	}
	if !o.once {
		return nil
	}
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return fmt.Errorf("outbox relay --once: timed out (--timeout) after relaying %d messages", st.Relayed)
	case ctx.Err() != nil:
		return fmt.Errorf("outbox relay --once: interrupted after relaying %d messages", st.Relayed)
	case st.Failures > 0:
		last := st.LastError
		if last == nil {
			last = errors.New("none recorded")
		}
		return fmt.Errorf("outbox relay --once: %s failed (%s quarantined); last error: %w",
			plural(st.FailedPublishes, "publish", "publishes"), plural(st.Quarantined, "row", "rows"), last)
	}
	return nil
}

// relayUntilIdle runs workers loops of Flush, each until a batch
// relays nothing: no row is ready (or every ready row failed).
func relayUntilIdle(ctx context.Context, log *slog.Logger, relay *outbox.Relay, workers int) {
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for ctx.Err() == nil {
				n, err := relay.Flush(ctx)
				if err != nil && ctx.Err() == nil {
					log.Error("outbox relay: rows failed, each is retried after its own backoff", "error", err, "relayed", n)
				}
				if n == 0 {
					return
				}
			}
		})
	}
	wg.Wait()
}

// reportEvery logs the relay's counters every interval while it runs; the
// returned func stops it.
func (a *app) reportEvery(ctx context.Context, log *slog.Logger, relay *outbox.Relay, interval time.Duration) func() {
	if interval <= 0 {
		return func() {}
	}
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-done:
				return
			case <-t.C:
				st := relay.Stats()
				log.Info("outbox relay progress", "relayed", st.Relayed, "batches", st.Batches,
					"failed_publishes", st.FailedPublishes, "quarantined", st.Quarantined)
			}
		}
	})
	return func() { close(done); wg.Wait() }
}

func (a *app) printRelaySummary(st outbox.RelayStats, took time.Duration, left outbox.Pending, leftErr error) error {
	if a.jsonOut {
		lastErr := ""
		if st.LastError != nil {
			lastErr = oneLine(st.LastError.Error())
		}
		type backlog struct {
			Pending          int64   `json:"pending"`
			OldestAgeSeconds float64 `json:"oldest_age_seconds"`
			Failing          int64   `json:"failing"`
			Quarantined      int64   `json:"quarantined"`
			BlockedKeys      int64   `json:"blocked_keys"`
			BlockedRows      int64   `json:"blocked_rows"`
		}
		var outboxLeft *backlog
		if leftErr == nil {
			outboxLeft = &backlog{left.Count, left.OldestAge.Seconds(), left.Failing, left.Quarantined, left.BlockedKeys, left.Blocked}
		}
		return a.printJSON(struct {
			Relayed         int64    `json:"relayed"`
			Batches         int64    `json:"batches"`
			FailedBatches   int64    `json:"failed_batches"`
			FailedPublishes int64    `json:"failed_publishes"`
			Quarantined     int64    `json:"quarantined"`
			LastError       string   `json:"last_error"`
			Seconds         float64  `json:"seconds"`
			Outbox          *backlog `json:"outbox"`
		}{st.Relayed, st.Batches, st.Failures, st.FailedPublishes, st.Quarantined, lastErr, took.Seconds(), outboxLeft})
	}
	fmt.Fprintf(a.stdout, "Relayed %s in %s (%s); %s failed, %s quarantined.\n",
		plural(st.Relayed, "message", "messages"), plural(st.Batches, "batch", "batches"), fmtDuration(took),
		plural(st.FailedPublishes, "publish", "publishes"), plural(st.Quarantined, "row", "rows"))
	if leftErr != nil {
		_, err := fmt.Fprintf(a.stdout, "Outbox now: unknown (%s).\n", oneLine(leftErr.Error()))
		return err
	}
	blocked := ""
	if left.BlockedKeys > 0 {
		blocked = fmt.Sprintf("; %s blocked (%s waiting behind a failed row of their key)",
			plural(left.BlockedKeys, "ordering key", "ordering keys"), plural(left.Blocked, "row", "rows"))
	}
	_, err := fmt.Fprintf(a.stdout, "Outbox now: %d pending, %d failing, %d quarantined%s.\n", left.Count, left.Failing, left.Quarantined, blocked)
	return err
}

// pendingOf is the backlog of db's outbox.
func pendingOf(ctx context.Context, db sqlschema.DB) (outbox.Pending, error) {
	s, err := outbox.NewStore(db)
	if err != nil {
		return outbox.Pending{}, err
	}
	return s.Pending(ctx)
}
