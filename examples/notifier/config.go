package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// Config is the notifier's configuration, read from the environment.
type Config struct {
	DatabaseURL string // DATABASE_URL: postgres://... (or a pgx connection string), or mysql://...
	AMQPURL     string // AMQP_URL
	// SMSProviderURL and EmailProviderURL are the providers' base URLs
	// (POST {url}/messages). Empty: a built-in fake provider runs in-process.
	SMSProviderURL   string // SMS_PROVIDER_URL
	EmailProviderURL string // EMAIL_PROVIDER_URL
	HTTPAddr         string // HTTP_ADDR
	Workers          int    // WORKERS: concurrent consumers of the send queue
	Lease            time.Duration
	// MaxAttempts parks a notification for an operator after this many
	// failed provider attempts (MAX_ATTEMPTS), instead of retrying forever.
	MaxAttempts int
	Relay       bool   // RELAY=off disables the in-process outbox relay
	Schema      string // DB_SCHEMA: the notifier's tables, inbox and outbox
	SendQueue   string // SEND_QUEUE
	SentQueue   string // SENT_QUEUE
	DeadQueue   string // DEAD_QUEUE: malformed or unidentifiable requests
	// MetricsInboxInterval is the shortest time between two inbox
	// statistics queries of /metrics (METRICS_INBOX_INTERVAL): each scans
	// the inbox table, so raise it on a large one.
	MetricsInboxInterval time.Duration
}

func env(name, def string) string {
	if v := strings.TrimSpace(os.Getenv(name)); v != "" {
		return v
	}
	return def
}

// LoadConfig reads the configuration; errors name the variable.
func LoadConfig() (Config, error) {
	c := Config{
		DatabaseURL:      env("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"),
		AMQPURL:          env("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
		SMSProviderURL:   strings.TrimRight(env("SMS_PROVIDER_URL", ""), "/"),
		EmailProviderURL: strings.TrimRight(env("EMAIL_PROVIDER_URL", ""), "/"),
		HTTPAddr:         env("HTTP_ADDR", "127.0.0.1:8080"),
		Schema:           env("DB_SCHEMA", "notifier"),
		SendQueue:        env("SEND_QUEUE", "notifications.send"),
		SentQueue:        env("SENT_QUEUE", "notifications.sent"),
	}
	c.DeadQueue = env("DEAD_QUEUE", c.SendQueue+".dead")
	workers, err := strconv.Atoi(env("WORKERS", "4"))
	if err != nil || workers < 1 || workers > 256 {
		return c, fmt.Errorf("WORKERS=%q: want a whole number from 1 to 256", os.Getenv("WORKERS"))
	}
	c.Workers = workers
	c.MaxAttempts, err = strconv.Atoi(env("MAX_ATTEMPTS", "10"))
	if err != nil || c.MaxAttempts < 1 {
		return c, fmt.Errorf("MAX_ATTEMPTS=%q: want a whole number >= 1", os.Getenv("MAX_ATTEMPTS"))
	}
	c.Lease, err = time.ParseDuration(env("INBOX_LEASE", "30s"))
	if err != nil || c.Lease < time.Second {
		return c, fmt.Errorf("INBOX_LEASE=%q: want a Go duration of at least 1s, like 30s", os.Getenv("INBOX_LEASE"))
	}
	switch strings.ToLower(env("RELAY", "on")) {
	case "on", "true", "1", "yes":
		c.Relay = true
	case "off", "false", "0", "no":
		c.Relay = false
	default:
		return c, fmt.Errorf("RELAY=%q: want on or off", os.Getenv("RELAY"))
	}
	c.MetricsInboxInterval, err = time.ParseDuration(env("METRICS_INBOX_INTERVAL", "15s"))
	if err != nil || c.MetricsInboxInterval <= 0 {
		return c, fmt.Errorf("METRICS_INBOX_INTERVAL=%q: want a positive Go duration, like 15s", os.Getenv("METRICS_INBOX_INTERVAL"))
	}
	return c, nil
}
