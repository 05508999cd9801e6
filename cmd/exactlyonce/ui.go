package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/spf13/cobra"

	"github.com/exactlyonce/watermill-exactlyonce/console"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// Environment variables of the ui command.
const (
	envUIToken    = "EXACTLYONCE_UI_TOKEN"
	envUIPassword = "EXACTLYONCE_UI_PASSWORD"
)

type uiOptions struct {
	listen         string
	token          string
	basicUser      string
	basicPassword  string
	insecure       bool
	readOnly       bool
	prefix         string
	consumers      []string
	redisURL       string
	redisPrefix    string
	doneTTL        time.Duration
	redisConsumers []string
	amqpURL        string
	queueType      string
	partitions     map[string]int
	statsInterval  time.Duration
	trustedOrigins []string
	allowedHosts   []string
	tlsCert        string
	tlsKey         string
	tlsInFront     bool
	logLevel       string
}

func (a *app) uiCmd() *cobra.Command {
	var o uiOptions
	cmd := &cobra.Command{
		Use:   "ui",
		Short: "Serve the web console and the admin API (package console) on a loopback address",
		Long: `Serves the console of package console: an overview of the consumers (processed, duplicates,
parked) and of the outbox (backlog, oldest age, quarantined), the parked messages and the
quarantined outbox rows with search, show, replay, discard and requeue (each confirmed with the
number of messages it touches), an inbox lookup by key, and the JSON admin API under /api/v1/.

It listens on --listen (127.0.0.1:8089: this machine only) and prints the address. Off the
loopback it serves HTTPS with --tls-cert and --tls-key, or plain HTTP behind a proxy or load
balancer that terminates TLS, which --tls-terminated-in-front states; without either it refuses
to start: the token, the password and the session cookie would cross the network in clear. On a
loopback address it answers only to the loopback's names (127.0.0.1, [::1], localhost) and to
--allowed-host, so that a page of another site whose name resolves to this machine (DNS
rebinding) is refused. Every request
is authenticated: --token (or $` + envUIToken + `: a bearer token for the API, and the login form of
the pages), or --basic-user with --basic-password (or $` + envUIPassword + `); without either, it
makes up a token and prints it. --insecure-no-auth serves without authentication, on a loopback
address only. --read-only refuses every action.

The PostgreSQL inbox and outbox come from --database-url (or $DATABASE_URL) and the table flags;
the Redis lease store from --redis-url (or $REDIS_URL when the flag is given empty), whose
consumers the overview shows with --redis-consumer, and whose replays publish through RabbitMQ
(--amqp-url or $AMQP_URL). It runs until SIGINT or SIGTERM.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error { return a.ui(cmd, o) },
	}
	f := cmd.Flags()
	f.StringVar(&o.listen, "listen", "127.0.0.1:8089", "address to listen on (host:port; a port of 0 picks a free one)")
	f.StringVar(&o.token, "token", "", "bearer token of the API and the login form, at least 16 bytes (default $"+envUIToken+"; prefer the variable: flags show in ps)")
	f.StringVar(&o.basicUser, "basic-user", "", "HTTP basic authentication: the user name (with --basic-password)")
	f.StringVar(&o.basicPassword, "basic-password", "", "HTTP basic authentication: the password, at least 16 bytes (default $"+envUIPassword+"; prefer the variable: flags show in ps)")
	f.BoolVar(&o.insecure, "insecure-no-auth", false, "serve without authentication (refused unless --listen is a loopback address)")
	f.BoolVar(&o.readOnly, "read-only", false, "refuse every action: look, never change")
	f.StringVar(&o.prefix, "prefix", "", "serve under this path (e.g. /exactlyonce, behind a reverse proxy)")
	f.StringArrayVar(&o.consumers, "consumer", nil, "a PostgreSQL consumer the overview shows (repeatable; default: those with records)")
	f.StringVar(&o.redisURL, "redis-url", "", "the Redis lease store: redis://host:6379/0 (given empty: $"+envRedisURL+")")
	f.StringVar(&o.redisPrefix, "redis-prefix", os.Getenv(envRedisPrefix), "the Redis store's key prefix, as the service's redisstore.Config.Prefix (default $"+envRedisPrefix+", else exactlyonce:)")
	f.DurationVar(&o.doneTTL, "redis-done-ttl", 7*24*time.Hour, "the Redis store's DoneTTL, as the service's")
	f.StringArrayVar(&o.redisConsumers, "redis-consumer", nil, "a consumer of the Redis store the overview shows (repeatable: the store keeps no list)")
	f.StringVar(&o.amqpURL, "amqp-url", "", "RabbitMQ, through which the Redis store's replays publish, or a cluster's nodes separated by commas (default $"+envAMQPURL+"; without it they are refused)")
	f.StringVar(&o.queueType, "queue-type", "classic", "the type of the queues a Redis store's replay declares, classic or quorum, as the relay's --queue-type")
	f.StringToIntVar(&o.partitions, "topic-partitions", nil, "partitioned topics, topic=n (repeatable), as the relay's --topic-partitions: a Redis store's replay goes to the partition queue of its ordering key")
	f.DurationVar(&o.statsInterval, "stats-interval", 30*time.Second, "compute the overview's figures at most this often (they scan the inbox)")
	f.StringArrayVar(&o.trustedOrigins, "trusted-origin", nil, "an origin whose pages may post actions, e.g. https://ops.example.com behind a proxy (repeatable)")
	f.StringArrayVar(&o.allowedHosts, "allowed-host", nil, "a name (host or host:port) requests may address the console by, besides the loopback's: a proxy's that keeps the client's Host (repeatable; on a loopback --listen every other name is refused)")
	f.StringVar(&o.tlsCert, "tls-cert", "", "serve HTTPS with this certificate (PEM file, the chain after the leaf; with --tls-key)")
	f.StringVar(&o.tlsKey, "tls-key", "", "the private key of --tls-cert (PEM file)")
	f.BoolVar(&o.tlsInFront, "tls-terminated-in-front", false, "serve plain HTTP off the loopback: a proxy or load balancer in front terminates TLS (without it or --tls-cert, a --listen off the loopback is refused)")
	f.StringVar(&o.logLevel, "log-level", "info", "debug, info, warn, error")
	return cmd
}

// isLoopback reports whether addr's host is a loopback address (or
// localhost): an empty host listens on every interface.
func isLoopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// uiTLS checks the transport the flags choose: HTTPS with --tls-cert and
// --tls-key (their pair, loaded: a bad file is refused at start, not at
// the first handshake), or plain HTTP on a loopback address, or off it
// when --tls-terminated-in-front says a proxy in front terminates TLS.
// It returns the TLS configuration to serve with, nil for plain HTTP.
func uiTLS(o uiOptions) (*tls.Config, error) {
	switch {
	case (o.tlsCert == "") != (o.tlsKey == ""):
		return nil, usageErr("--tls-cert and --tls-key go together: give the certificate and its private key (PEM files)")
	case o.tlsCert != "" && o.tlsInFront:
		return nil, usageErr("--tls-terminated-in-front with --tls-cert: the console serves HTTPS itself with the certificate; drop --tls-terminated-in-front")
	case o.tlsCert != "":
		cert, err := tls.LoadX509KeyPair(o.tlsCert, o.tlsKey)
		if err != nil {
			return nil, usageErr("--tls-cert, --tls-key: %v", err)
		}
		return &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS12}, nil
	case !isLoopback(o.listen) && !o.tlsInFront:
		return nil, usageErr("--listen %s is not a loopback address, and the console would serve plain HTTP there: the token, the password and the session cookie would cross the network in clear."+
			" Serve HTTPS with --tls-cert FILE --tls-key FILE; or, if a proxy or load balancer in front terminates TLS, say so with --tls-terminated-in-front;"+
			" or listen on this machine only (--listen 127.0.0.1:8089)", o.listen)
	}
	return nil, nil
}

// uiAllowedHosts are the names the console answers to: on a loopback
// --listen, its host (which makes the console check every request's
// Host, with authentication too) and --allowed-host; else --allowed-host
// only (none: any name).
func uiAllowedHosts(o uiOptions) []string {
	hosts := append([]string(nil), o.allowedHosts...)
	if isLoopback(o.listen) {
		host, _, _ := net.SplitHostPort(o.listen)
		hosts = append(hosts, host)
	}
	return hosts
}

// uiAuth chooses the authentication from the flags; generated is a token
// made up because none was given.
func (a *app) uiAuth(cmd *cobra.Command, o uiOptions) (auth console.Authenticator, generated string, err error) {
	token := flagOrEnv(cmd.Flags(), "token", o.token, envUIToken)
	password := flagOrEnv(cmd.Flags(), "basic-password", o.basicPassword, envUIPassword)
	basic := o.basicUser != "" || cmd.Flags().Changed("basic-password")
	switch {
	case o.insecure && (token != "" || basic):
		return nil, "", usageErr("--insecure-no-auth with a token or basic credentials: choose one")
	case o.insecure && !isLoopback(o.listen):
		return nil, "", usageErr("--insecure-no-auth serves without authentication: it is refused unless --listen is a loopback address (127.0.0.1:8089), not %q", o.listen)
	case o.insecure:
		return nil, "", nil
	case token != "" && basic:
		return nil, "", usageErr("a token and basic credentials: choose one")
	case basic:
		if o.basicUser == "" || password == "" {
			return nil, "", usageErr("basic authentication needs --basic-user and --basic-password (or $%s)", envUIPassword)
		}
		if len(password) < console.MinPasswordLength {
			return nil, "", usageErr("the password is shorter than %d bytes: choose a longer one (a few words, or openssl rand -base64 24)", console.MinPasswordLength)
		}
		return console.BasicAuth(o.basicUser, password), "", nil
	case token != "":
		if len(token) < console.MinTokenLength {
			return nil, "", usageErr("the token is shorter than %d bytes: generate one (openssl rand -hex 32)", console.MinTokenLength)
		}
		return console.BearerToken(token), "", nil
	}
	var b [24]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, "", err
	}
	generated = hex.EncodeToString(b[:])
	return console.BearerToken(generated), generated, nil
}

func (a *app) ui(cmd *cobra.Command, o uiOptions) error {
	log, err := a.logger(o.logLevel)
	if err != nil {
		return err
	}
	auth, generated, err := a.uiAuth(cmd, o)
	if err != nil {
		return err
	}
	tlsConfig, err := uiTLS(o)
	if err != nil {
		return err
	}
	if o.statsInterval <= 0 {
		return usageErr("--stats-interval must be positive")
	}
	if o.prefix != "" && (!strings.HasPrefix(o.prefix, "/") || strings.HasSuffix(o.prefix, "/")) {
		return usageErr("--prefix %q: a path such as /exactlyonce (a leading slash, no trailing one)", o.prefix)
	}
	cfg := console.Config{Auth: auth, InsecureNoAuth: auth == nil, ReadOnly: o.readOnly, Prefix: o.prefix, Logger: log,
		StatsInterval: o.statsInterval, TrustedOrigins: o.trustedOrigins, Consumers: o.consumers, RedisConsumers: o.redisConsumers,
		AllowedHosts: uiAllowedHosts(o)}

	// Connecting: bounded by --connect-timeout (and a signal); the
	// server then runs until a signal.
	ctx := a.ctx
	useDB := flagOrEnv(cmd.Flags(), "database-url", a.databaseURL, envDatabaseURL) != ""
	useRedis := cmd.Flags().Changed("redis-url")
	if !useDB && !useRedis {
		return usageErr("no database: set %s or --database-url (and/or --redis-url for the Redis lease store)", envDatabaseURL)
	}
	if useDB {
		db, closeDB, err := a.open(ctx, cmd, 8, true)
		if err != nil {
			return err
		}
		defer closeDB()
		cfg.DB = db
	} else if len(o.consumers) > 0 {
		return usageErr("--consumer names PostgreSQL consumers: without a database, name the Redis store's with --redis-consumer")
	}
	if !useRedis && len(o.redisConsumers) > 0 {
		return usageErr("--redis-consumer without --redis-url")
	}
	if useRedis {
		store, client, err := a.uiRedis(ctx, o)
		if err != nil {
			return err
		}
		defer client.Close()
		cfg.Redis = store
		if url := flagOrEnv(cmd.Flags(), "amqp-url", o.amqpURL, envAMQPURL); url != "" {
			if err := checkQueueType(o.queueType); err != nil {
				return err
			}
			pub, err := rabbitmq.NewPublisher(brokerConfig(url, o.queueType, o.partitions))
			if err != nil {
				return usageErr("--amqp-url, --topic-partitions: %v", err)
			}
			defer pub.Close()
			cfg.RedisReplayPublisher = pub
		}
	}
	h, err := console.New(cfg)
	if err != nil {
		return usageErr("%s", strings.TrimPrefix(err.Error(), "console: New: "))
	}

	ln, err := net.Listen("tcp", o.listen)
	if err != nil {
		return fmt.Errorf("--listen %s: %w", o.listen, err)
	}
	mux := http.NewServeMux()
	if o.prefix == "" {
		mux.Handle("/", h)
	} else {
		mux.Handle(o.prefix+"/", h)
		mux.Handle(o.prefix, h)
		mux.Handle("/{$}", http.RedirectHandler(o.prefix+"/", http.StatusSeeOther))
	}
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: time.Minute, WriteTimeout: 10 * time.Minute,
		IdleTimeout: 2 * time.Minute, TLSConfig: tlsConfig}
	scheme := "http"
	if tlsConfig != nil {
		scheme = "https"
	}
	url := scheme + "://" + ln.Addr().String() + o.prefix + "/"
	what := []string{}
	if cfg.DB.Conn != nil {
		what = append(what, fmt.Sprintf("inbox %s.%s, outbox %s.%s", cfg.DB.Schema, cfg.DB.InboxTable, cfg.DB.Schema, cfg.DB.OutboxTable))
	}
	if cfg.Redis != nil {
		what = append(what, "the Redis lease store")
	}
	fmt.Fprintf(a.stdout, "Serving the exactlyonce console on %s (%s)%s.\n", url, strings.Join(what, "; "), map[bool]string{true: ", read-only", false: ""}[o.readOnly])
	switch {
	case generated != "":
		fmt.Fprintf(a.stdout, "Sign in with this token (made up for this run; set $%s to choose one): %s\n", envUIToken, generated)
	case auth == nil:
		fmt.Fprintln(a.stdout, "WARNING: no authentication (--insecure-no-auth): anyone who can reach this address can replay and discard messages.")
	}
	if o.tlsInFront {
		fmt.Fprintln(a.stdout, "Plain HTTP, for a proxy in front that terminates TLS (--tls-terminated-in-front): let nothing else reach this address.")
	}
	fmt.Fprintln(a.stdout, "Ctrl-C stops it.")

	served := make(chan error, 1)
	go func() {
		if tlsConfig != nil {
			served <- srv.ServeTLS(ln, "", "") // the certificate is in srv.TLSConfig
			return
		}
		served <- srv.Serve(ln)
	}()
	select {
	case err := <-served:
		return fmt.Errorf("serving: %w", err)
	case <-ctx.Done():
	}
	a.stopSignals() // a second signal ends the process at once
	log.Info("exactlyonce console stopping: finishing the requests in flight")
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	if err := <-served; err != nil && !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("serving: %w", err)
	}
	log.Info("exactlyonce console stopped")
	return nil
}

// uiRedis connects to the Redis lease store of the flags.
func (a *app) uiRedis(ctx context.Context, o uiOptions) (*redisstore.Store, *redis.Client, error) {
	url := o.redisURL
	if url == "" {
		url = os.Getenv(envRedisURL)
	}
	if url == "" {
		return nil, nil, usageErr("--redis-url is empty and $%s is not set", envRedisURL)
	}
	opts, err := redis.ParseURL(url)
	if err != nil {
		return nil, nil, usageErr("--redis-url: %v", err)
	}
	client := redis.NewClient(opts)
	pctx, cancel := context.WithTimeout(ctx, a.connectTimeout)
	defer cancel()
	if err := client.Ping(pctx).Err(); err != nil {
		_ = client.Close()
		return nil, nil, fmt.Errorf("redis at %s: %w", opts.Addr, err)
	}
	store, err := redisstore.New(redisstore.Config{Client: client, Prefix: o.redisPrefix, DoneTTL: o.doneTTL})
	if err != nil {
		_ = client.Close()
		return nil, nil, usageErr("%v", err)
	}
	return store, client, nil
}
