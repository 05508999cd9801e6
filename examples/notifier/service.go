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
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// sendConsumer is the inbox consumer name of the send handler: the same in
// every worker and every instance, so they share one set of keys.
const sendConsumer = "notifier-send"

// sendHandler is the router handler's name (in logs and in the
// handler_poisoned header of dead letters).
const sendHandler = "send"

// Service is one notifier instance.
type Service struct {
	cfg      Config
	hooks    hooks
	logger   *slog.Logger
	wlogger  watermill.LoggerAdapter
	db       sqlschema.DB // the database and the library's tables: stated once, passed everywhere
	ping     func(context.Context) error
	st       statements // the notifier's own, in db's dialect (queries/)
	store    *inbox.Store
	receipts *exactlyonce.Guard

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

// hooks let the demo observe and disturb deliveries; the service itself
// runs with none.
type hooks struct {
	// outer, when set, wraps the whole send handler chain (outermost).
	outer message.HandlerMiddleware
	// expected lists errors the router logs at debug level instead of
	// error, beside exactlyonce.ErrLeaseHeld.
	expected []error
}

// NewService connects, migrates, declares the queues and wires everything;
// Run starts it.
func NewService(ctx context.Context, cfg Config, logger *slog.Logger) (*Service, error) {
	return newService(ctx, cfg, logger, hooks{})
}

func newService(ctx context.Context, cfg Config, logger *slog.Logger, h hooks) (s *Service, err error) {
	s = &Service{cfg: cfg, hooks: h, logger: logger, wlogger: watermill.NewSlogLogger(logger)}
	defer func() {
		if err != nil {
			s.close()
		}
	}()
	// PostgreSQL (pgx) or MySQL/MariaDB (database/sql), by the URL's
	// scheme; it connects lazily.
	conn, err := openDatabase(ctx, cfg.DatabaseURL, cfg.Workers+4)
	if err != nil {
		return nil, fmt.Errorf("DATABASE_URL: %w", err)
	}
	s.closers = append(s.closers, func() error { conn.close(); return nil })
	s.db, s.ping = conn.conn, conn.ping
	s.db.Schema = cfg.Schema
	if err := s.db.Validate(); err != nil {
		return nil, fmt.Errorf("DB_SCHEMA: %w", err)
	}
	if s.st, err = loadStatements(s.db); err != nil {
		return nil, err
	}
	if err := s.ping(ctx); err != nil {
		return nil, fmt.Errorf("%s at DATABASE_URL is unreachable: %w", engineName(s.db.Dialect), err)
	}
	if err := migrate(ctx, s.db, s.st); err != nil {
		return nil, fmt.Errorf("migrating: %w", err)
	}
	if s.store, err = inbox.NewStore(s.db); err != nil {
		return nil, err
	}
	// Declare the queues up front: RabbitMQ drops what the relay or the
	// dead-letter middleware publishes to a queue nobody declared yet.
	if err := rabbitmq.DeclareQueues(ctx, cfg.AMQPURL, cfg.SendQueue, cfg.SentQueue, cfg.DeadQueue); err != nil {
		return nil, fmt.Errorf("RabbitMQ at AMQP_URL: %w", err)
	}
	if err := s.setUpProviders(); err != nil {
		return nil, err
	}
	if s.metrics, err = newMetrics(s); err != nil {
		return nil, fmt.Errorf("metrics: %w", err)
	}
	if err := s.setUpRouter(); err != nil {
		return nil, err
	}
	if err := s.setUpReceipts(); err != nil {
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

func (s *Service) setUpProviders() error {
	client := &http.Client{Timeout: 10 * time.Second}
	s.providers = map[string]Provider{}
	for _, channel := range []string{"sms", "email"} {
		url := s.cfg.SMSProviderURL
		if channel == "email" {
			url = s.cfg.EmailProviderURL
		}
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

// amqpConfig is the watermill-amqp configuration of every subscriber and
// publisher: durable queues named like the topic, rabbitmq.Marshaler (the
// message identity is the Watermill UUID header, else the AMQP message_id
// property that PHP, Node or Python producers set; headers of any type,
// such as RabbitMQ's x-death, become text instead of failing the delivery)
// and publisher confirms.
func amqpConfig(amqpURL string) wamqp.Config {
	c := wamqp.NewDurableQueueConfig(amqpURL)
	c.Marshaler = rabbitmq.Marshaler{}
	c.Publish.ConfirmDelivery = true
	// No channel pool: watermill-amqp v3.1.0's pool can lose all its
	// channels after a broker outage, and Publish then blocks forever
	// (upstream fix: ThreeDotsLabs/watermill-amqp#37).
	c.Publish.ChannelPoolSize = 0
	return c
}

func (s *Service) setUpRouter() error {
	var err error
	// The router logs every handler error at error level. RouterLogger (the
	// recommended set-up) logs at debug what the middleware already
	// reported (an outage, as a few lines) or expects (a held lease:
	// another worker is on the key); quietLogger adds the errors this
	// service expects (the demo's injected lost ack).
	routerLogger := quietLogger{LoggerAdapter: exactlyonce.RouterLogger(s.wlogger), expected: s.hooks.expected}
	s.router, err = message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, routerLogger)
	if err != nil {
		return err
	}
	// The dead-letter publisher is the router's own, not shared with the
	// relay.
	deadPub, err := wamqp.NewPublisher(amqpConfig(s.cfg.AMQPURL), s.wlogger)
	if err != nil {
		return fmt.Errorf("RabbitMQ publisher: %w", err)
	}
	s.closers = append(s.closers, deadPub.Close)
	// IsPermanent: no key (or an invalid one), a malformed request
	// (validate marks it Permanent), output the outbox can never take.
	deadLetter, err := middleware.PoisonQueueWithFilter(deadPub, s.cfg.DeadQueue, exactlyonce.IsPermanent)
	if err != nil {
		return err
	}
	eo, err := exactlyonce.New(exactlyonce.Config{
		DB:           s.db,
		Lease:        &exactlyonce.LeaseConfig{Duration: s.cfg.Lease},
		Consumer:     sendConsumer,
		PublishTopic: s.cfg.SentQueue,
		OnEvent:      s.metrics.lib.OnEvent,
		Logger:       s.wlogger,
	})
	if err != nil {
		return err
	}
	retry := middleware.Retry{
		MaxRetries: 2, InitialInterval: 200 * time.Millisecond, Multiplier: 2, Logger: s.wlogger,
		// Retrying cannot fix a permanent error, and a held lease is the
		// holder's to finish: nack those at once.
		ShouldRetry: func(p middleware.RetryParams) bool {
			return !exactlyonce.IsPermanent(p.Err) && !errors.Is(p.Err, exactlyonce.ErrLeaseHeld)
		},
	}
	// Outermost first: dead-letter what can never succeed, validate before
	// any claim, retry transient failures with a fresh attempt each time.
	// No Recoverer: the exactly-once middleware recovers handler panics
	// itself (rolled back and nacked).
	if s.hooks.outer != nil {
		s.router.AddMiddleware(s.hooks.outer)
	}
	s.router.AddMiddleware(deadLetter, validate, retry.Middleware, eo.Middleware)

	sub, err := wamqp.NewSubscriber(amqpConfig(s.cfg.AMQPURL), s.wlogger)
	if err != nil {
		return fmt.Errorf("RabbitMQ subscriber: %w", err)
	}
	s.closers = append(s.closers, sub.Close)
	// One handler, Workers deliveries in flight under one consumer name.
	// The middleware writes the returned event to the outbox; OutboxOnly
	// only carries the publish topic (the event's destination) and refuses
	// anything the router would publish itself.
	s.router.AddHandler(sendHandler, s.cfg.SendQueue, exactlyonce.ConcurrentSubscriber(sub, s.cfg.Workers),
		s.cfg.SentQueue, exactlyonce.OutboxOnly(), s.send)
	return nil
}

// setUpReceipts builds the exactly-once middleware of the receipts webhook
// (transactional mode, keyed on the SHA-256 of the body): the same
// middleware as the queue handler's, called from an HTTP handler.
func (s *Service) setUpReceipts() error {
	var err error
	s.receipts, err = exactlyonce.New(exactlyonce.Config{
		DB:        s.db,
		Consumer:  receiptsConsumer,
		Key:       exactlyonce.KeyFromPayloadSHA256,
		OnEvent:   s.metrics.lib.OnEvent,
		NackDelay: -1, // the webhook answers at once; the provider retries
		Logger:    s.wlogger,
	})
	return err
}

func (s *Service) setUpRelay() error {
	// The relay's own publisher: the router closes the publishers of its
	// handlers when it stops, and the relay must be able to finish.
	pub, err := wamqp.NewPublisher(amqpConfig(s.cfg.AMQPURL), s.wlogger)
	if err != nil {
		return fmt.Errorf("RabbitMQ publisher: %w", err)
	}
	s.closers = append(s.closers, pub.Close)
	s.relay, err = outbox.NewRelay(outbox.RelayConfig{
		DB: s.db, Publisher: pub, PollInterval: 100 * time.Millisecond, Logger: s.wlogger,
	})
	if err != nil {
		return err
	}
	return s.metrics.lib.WatchRelay(s.relay)
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
	shutdownHTTP := func() {
		shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = s.http.Shutdown(shutdownCtx)
	}
	select {
	case <-s.router.Running():
		s.running.Store(true)
		s.logger.Info("notifier running", "http", s.HTTPAddr(), "workers", s.cfg.Workers,
			"send_queue", s.cfg.SendQueue, "sent_queue", s.cfg.SentQueue, "relay", s.relay != nil)
	case err := <-errs:
		_ = s.router.Close()
		<-routerDone
		stopRelay()
		<-relayDone
		shutdownHTTP()
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
	shutdownHTTP()
	return runErr
}

func (s *Service) close() {
	for i := len(s.closers) - 1; i >= 0; i-- {
		_ = s.closers[i]()
	}
	s.closers = nil
}
