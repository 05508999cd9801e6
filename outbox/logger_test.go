package outbox_test

import (
	"context"
	"log"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// A relay with no Logger logs its failures through slog.Default(): a relay
// that cannot publish is never silent. Not parallel: it replaces the
// process's default logger (and restores it, and the log package's output
// that slog.SetDefault redirects).
func TestRelayLogsToSlogDefaultWithoutLogger(t *testing.T) {
	var buf syncBuffer
	prevLogger, prevWriter, prevFlags := slog.Default(), log.Writer(), log.Flags()
	slog.SetDefault(slog.New(slog.NewTextHandler(&buf, nil)))
	t.Cleanup(func() {
		slog.SetDefault(prevLogger)
		log.SetOutput(prevWriter)
		log.SetFlags(prevFlags)
	})

	d := testenv.Drivers(t)[0]
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b := newBundle(t, ctx, d.DB, testenv.Schema(t))
	b.publish(t, "t", message.NewMessage("m1", nil))

	rec := &recorder{failTopic: "t"}
	relay, err := outbox.NewRelay(outbox.RelayConfig{
		DB: b.schema(), Publisher: rec, // no Logger
		PollInterval: 5 * time.Millisecond, ErrorBackoff: 5 * time.Millisecond, MaxErrorBackoff: 20 * time.Millisecond,
	})
	require.NoError(t, err)
	stop := runRelay(t, relay)
	testenv.Eventually(t, 10*time.Second, func() bool { return strings.Contains(buf.String(), errBrokerDown.Error()) },
		"the failed batch should be logged through slog.Default()")
	stop()

	var line string
	for _, l := range strings.Split(buf.String(), "\n") {
		if strings.Contains(l, errBrokerDown.Error()) {
			line = l
			break
		}
	}
	require.Contains(t, line, "level=ERROR")
	require.Contains(t, line, "outbox relay: rows failed, each is retried after its own backoff")
	require.Positive(t, relay.Stats().Failures)
	require.Equal(t, int64(1), b.pending(t, b.db), "nothing was relayed")
}
