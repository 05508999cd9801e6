package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	wmw "github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/middleware"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// sendConsumer is the inbox consumer name of the send handler: the same in
// every worker and every instance, so they share one set of keys.
const sendConsumer = "notifier-send"

// Service is one notifier instance.
type Service struct {
	cfg      Config
	logger   *slog.Logger
	wlogger  watermill.LoggerAdapter
	pool     *pgxpool.Pool
	db       wsql.Beginner
	tables   sqlschema.Config
	logTable string
	store    *inbox.Store

	providers map[string]Provider
	fakes     []*fakeProvider

	router  *message.Router
	relay   *outbox.Relay
	metrics *metrics
	http    *http.Server
	httpLn  net.Listener
	running atomic.Bool

	closers []func() error
}

// NewService connects, migrates, declares the queues and wires everything;
// Run starts it.
func NewService(ctx context.Context, cfg Config, logger *slog.Logger) (s *Service, err error) {
	s = &Service{
		cfg: cfg, logger: logger,
		wlogger: watermill.NewSlogLogger(logger),
		tables:  sqlschema.Config{Schema: cfg.Schema},
	}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	if err := s.tables.Validate(); err != nil {
		return nil, fmt.Errorf("DB_SCHEMA: %w", err)
	}
	s.logTable = logTable(s.tables)

	s.pool, err = pgxpool.New(ctx, cfg.DatabaseURL)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	s.closers = append(s.closers, func() error { s.pool.Close(); return nil })
	if err := s.pool.Ping(ctx); err != nil {
		return nil, fmt.Errorf("PostgreSQL at DATABASE_URL is unreachable: %w", err)
	}
	s.db = wsql.BeginnerFromPgx(s.pool)
	if err := migrate(ctx, s.pool, s.tables); err != nil {
		return nil, fmt.Errorf("migrating: %w", err)
	}
	if s.store, err = inbox.NewStore(inbox.Config{Tables: s.tables}); err != nil {
		return nil, err
	}
	if err := s.declareQueues(); err != nil {
		return nil, err
	}
	if err := s.setUpProviders(); err != nil {
		return nil, err
	}
	s.metrics = newMetrics(s)
	if err := s.setUpRouter(); err != nil {
		return nil, err
	}
	if cfg.Relay {
		if err := s.setUpRelay(); err != nil {
			return nil, err
		}
	}
	s.httpLn, err = net.Listen("tcp", cfg.HTTPAddr)
	if err != nil {
		return nil, fmt.Errorf("HTTP_ADDR: %w", err)
	}
	s.http = &http.Server{Handler: s.routes(), ReadHeaderTimeout: 5 * time.Second}
	return s, nil
}

// HTTPAddr is the address the HTTP server listens on.
func (s *Service) HTTPAddr() string { return s.httpLn.Addr().String() }

// declareQueues declares the durable queues at start, so that no event is
// dropped for lack of a queue (watermill-amqp's publisher declares none).
func (s *Service) declareQueues() error {
	conn, err := amqp.Dial(s.cfg.AMQPURL)
	if err != nil {
		return fmt.Errorf("RabbitMQ at AMQP_URL is unreachable: %w", err)
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	for _, q := range []string{s.cfg.SendQueue, s.cfg.SentQueue, s.cfg.DeadQueue} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			return fmt.Errorf("declaring queue %q: %w", q, err)
		}
	}
	return ch.Close()
}

func (s *Service) setUpProviders() error {
	client := &http.Client{Timeout: 10 * time.Second}
	s.providers = map[string]Provider{}
	for channel, url := range map[string]string{"sms": s.cfg.SMSProviderURL, "email": s.cfg.EmailProviderURL} {
		if url == "" {
			f, err := startFakeProvider(channel, s.logger)
			if err != nil {
				return err
			}
			s.fakes = append(s.fakes, f)
			s.closers = append(s.closers, f.Close)
			url = f.URL()
			s.logger.Info("no provider URL set: using the built-in fake provider", "channel", channel)
		}
		s.providers[channel] = Provider{Name: channel, BaseURL: url, Client: client}
	}
	return nil
}

func (s *Service) amqpConfig() wamqp.Config {
	c := wamqp.NewDurableQueueConfig(s.cfg.AMQPURL)
	c.Marshaler = identityMarshaler{}
	c.Publish.ConfirmDelivery = true
	// No channel pool: watermill-amqp v3.1.0's pool can lose all its
	// channels after a broker outage, and Publish then blocks forever
	// (docs/getting-started.md, "Run the relay").
	c.Publish.ChannelPoolSize = 0
	c.Consume.Qos.PrefetchCount = 4
	return c
}

func (s *Service) setUpRouter() error {
	var err error
	s.router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, s.wlogger)
	if err != nil {
		return err
	}
	deadPub, err := wamqp.NewPublisher(s.amqpConfig(), s.wlogger)
	if err != nil {
		return fmt.Errorf("RabbitMQ publisher: %w", err)
	}
	s.closers = append(s.closers, deadPub.Close)
	deadLetter, err := wmw.PoisonQueueWithFilter(deadPub, s.cfg.DeadQueue, isDeadLetter)
	if err != nil {
		return err
	}
	eo, err := middleware.New(middleware.Config{
		DB:           s.db,
		Tables:       s.tables,
		Mode:         middleware.Lease,
		Lease:        s.cfg.Lease,
		Consumer:     sendConsumer,
		PublishTopic: s.cfg.SentQueue,
		OnEvent:      s.metrics.observe,
		Logger:       s.wlogger,
	})
	if err != nil {
		return err
	}
	retry := wmw.Retry{
		MaxRetries: 2, InitialInterval: 200 * time.Millisecond, Multiplier: 2, Logger: s.wlogger,
		// Retrying cannot fix a dead letter, and a held lease is the holder's
		// to finish: nack those at once.
		ShouldRetry: func(p wmw.RetryParams) bool {
			return !isDeadLetter(p.Err) && !errors.Is(p.Err, middleware.ErrLeaseHeld)
		},
	}
	// Outermost first: dead-letter what can never succeed, validate before
	// any claim, retry transient failures with a fresh attempt each time.
	s.router.AddMiddleware(deadLetter, validate, retry.Middleware, eo.Middleware)

	for i := range s.cfg.Workers {
		sub, err := wamqp.NewSubscriber(s.amqpConfig(), s.wlogger)
		if err != nil {
			return fmt.Errorf("RabbitMQ subscriber: %w", err)
		}
		s.closers = append(s.closers, sub.Close)
		// The middleware writes the returned event to the outbox and
		// returns nothing to the router: the publish topic only names the
		// event's destination, and the router's publisher is never used.
		s.router.AddHandler(fmt.Sprintf("send-%d", i), s.cfg.SendQueue, sub, s.cfg.SentQueue, unusedPublisher{}, s.send)
	}
	return nil
}

// isDeadLetter reports errors that no retry can fix: the message goes to the
// dead-letter queue with the reason.
func isDeadLetter(err error) bool {
	return errors.Is(err, ErrInvalidRequest) || errors.Is(err, middleware.ErrEmptyKey) ||
		errors.Is(err, middleware.ErrKeyTooLong) || errors.Is(err, middleware.ErrInvalidKey)
}

// unusedPublisher stands in for the router's publisher of the send
// handlers (the router closes a handler's publisher when the handler stops,
// so a shared real one would be closed under the others).
type unusedPublisher struct{}

func (unusedPublisher) Publish(topic string, _ ...*message.Message) error {
	return fmt.Errorf("notifier: the router was asked to publish to %q; events go through the outbox", topic)
}

func (unusedPublisher) Close() error { return nil }

func (s *Service) setUpRelay() error {
	pub, err := wamqp.NewPublisher(s.amqpConfig(), s.wlogger)
	if err != nil {
		return fmt.Errorf("RabbitMQ publisher: %w", err)
	}
	s.closers = append(s.closers, pub.Close)
	s.relay, err = outbox.NewRelay(outbox.RelayConfig{
		DB: s.db, Publisher: pub, Tables: s.tables, PollInterval: 100 * time.Millisecond, Logger: s.wlogger,
	})
	return err
}

func (s *Service) routerRunning() bool { return s.running.Load() }

// Run serves until ctx ends, then shuts down gracefully: the router stops
// taking messages and waits (up to 30s) for the ones in flight, which finish
// and are acked, or are not acked at all; then the relay and the HTTP
// server stop.
func (s *Service) Run(ctx context.Context) error {
	defer s.close()
	errs := make(chan error, 3)
	go func() {
		if err := s.http.Serve(s.httpLn); err != nil && !errors.Is(err, http.ErrServerClosed) {
			errs <- fmt.Errorf("HTTP server: %w", err)
		}
	}()
	relayCtx, stopRelay := context.WithCancel(context.WithoutCancel(ctx))
	relayDone := make(chan struct{})
	go func() {
		defer close(relayDone)
		if s.relay != nil {
			_ = s.relay.Run(relayCtx)
		}
	}()
	routerDone := make(chan struct{})
	go func() {
		defer close(routerDone)
		if err := s.router.Run(context.WithoutCancel(ctx)); err != nil {
			errs <- fmt.Errorf("router: %w", err)
		}
	}()
	select {
	case <-s.router.Running():
		s.running.Store(true)
		s.logger.Info("notifier running", "http", s.HTTPAddr(), "workers", s.cfg.Workers,
			"send_queue", s.cfg.SendQueue, "sent_queue", s.cfg.SentQueue, "relay", s.relay != nil)
	case err := <-errs:
		stopRelay()
		<-relayDone
		return err
	}

	var runErr error
	select {
	case <-ctx.Done():
		s.logger.Info("shutting down: finishing in-flight messages")
	case runErr = <-errs:
	}
	s.running.Store(false)
	_ = s.router.Close()
	<-routerDone
	stopRelay()
	<-relayDone
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = s.http.Shutdown(shutdownCtx)
	return runErr
}

func (s *Service) close() {
	for i := len(s.closers) - 1; i >= 0; i-- {
		_ = s.closers[i]()
	}
	s.closers = nil
}
