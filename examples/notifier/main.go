// Command notifier is a notification service built on watermill-exactlyonce:
// it consumes send requests from RabbitMQ, sends each SMS or e-mail through
// an HTTP provider exactly once per notification (lease mode, with a stable
// idempotency key), records it in notification_log, and emits a
// notification.sent event through the transactional outbox.
//
// Run `make demo` for a guided run, or `go run ./notifier` (from examples/) for the
// service itself. See examples/notifier/README.md for the configuration.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	demo := flag.Bool("demo", false, "run the demo: start the notifier with fake providers, publish sample requests (with duplicates and a redelivery), print what happened, stop")
	flag.Parse()

	level := slog.LevelInfo
	if *demo {
		level = slog.LevelWarn
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	var err error
	if *demo {
		err = runDemo(ctx, logger, os.Stdout)
	} else {
		err = run(ctx, logger)
	}
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "notifier:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, logger *slog.Logger) error {
	cfg, err := LoadConfig()
	if err != nil {
		return err
	}
	s, err := NewService(ctx, cfg, logger)
	if err != nil {
		return err
	}
	return s.Run(ctx)
}
