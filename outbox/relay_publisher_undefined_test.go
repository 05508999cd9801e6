package outbox_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// sqlBroker stands for a publisher that is itself SQL-backed (watermill-sql
// as the broker, or a publisher writing an audit row): one topic's table is
// missing on ITS side, so its Publish fails with SQLSTATE 42P01.
type sqlBroker struct{ recorder }

func (p *sqlBroker) Publish(topic string, msgs ...*message.Message) error {
	if topic == "missing" {
		return fmt.Errorf("could not insert message as row: %w",
			&pgconn.PgError{Severity: "ERROR", Code: "42P01", Message: `relation "watermill_missing" does not exist`})
	}
	return p.recorder.Publish(topic, msgs...)
}

// TestRelayPublisherUndefinedTableIsNotOutboxNotMigrated: the broker's own
// error about ITS missing table (SQLSTATE 42P01) is not the outbox's. Before
// the fix it was reported as "the outbox table is not migrated", and Run
// then waited MaxErrorBackoff (here an hour) after the batch that held that
// row, although the other rows flowed: 9 of 30 relayed.
func TestRelayPublisherUndefinedTableIsNotOutboxNotMigrated(t *testing.T) {
	t.Parallel()
	eachDriver(t, func(t *testing.T, b bundle) {
		b.publish(t, "missing", message.NewMessage(watermill.NewUUID(), []byte("x")))
		for i := 0; i < 30; i++ {
			b.publish(t, "ok", message.NewMessage(watermill.NewUUID(), []byte("y")))
		}
		pub := &sqlBroker{}
		logger := watermill.NewCaptureLogger()
		relay, err := outbox.NewRelay(outbox.RelayConfig{
			DB: b.schema(), Publisher: pub, Logger: logger, BatchSize: 10,
			PollInterval: 10 * time.Millisecond, ErrorBackoff: 10 * time.Millisecond, MaxErrorBackoff: time.Hour,
		})
		require.NoError(t, err)
		stop := runRelay(t, relay)
		deadline := time.Now().Add(30 * time.Second) // far less than MaxErrorBackoff
		for pub.count() < 30 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		stop()
		for _, l := range logger.Captured()[watermill.ErrorLogLevel] {
			require.NotErrorIs(t, l.Err, sqlschema.ErrNotMigrated, "logged as not migrated: %s: %v", l.Msg, l.Err)
		}
		require.NotErrorIs(t, relay.Stats().LastError, sqlschema.ErrNotMigrated, "the outbox IS migrated; the broker failed")
		require.Equal(t, 30, pub.count(), "the healthy rows behind the failing one are relayed")
	})
}
