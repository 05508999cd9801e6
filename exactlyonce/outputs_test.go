package exactlyonce_test

import (
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// TestTransactionalOutputs: where the messages a handler returns go, and
// what happens to the ones the outbox cannot take.
func TestTransactionalOutputs(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		ctx, d, tables := b.Ctx, b.Driver, b.DB
		const nackDelay = 150 * time.Millisecond
		newMW := func(publishTopic string) *exactlyonce.Guard {
			eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, Consumer: "c",
				PublishTopic: publishTopic, NackDelay: nackDelay, Logger: testenv.Logger(t)})
			require.NoError(t, err)
			return eo
		}
		type row struct{ Topic, UUID, Meta string }
		rows := func() []row {
			rs, err := d.DB.QueryContext(ctx, "SELECT topic, uuid, "+b.SQL("metadata::text", "metadata")+" FROM "+tables.Outbox()+" ORDER BY id")
			require.NoError(t, err)
			var out []row
			for rs.Next() {
				var r row
				require.NoError(t, rs.Scan(&r.Topic, &r.UUID, &r.Meta))
				out = append(out, r)
			}
			require.NoError(t, seam.Close(rs))
			return out
		}
		inboxRows := func() int64 { return count(t, d, "SELECT count(*) FROM "+tables.Inbox()) }

		// Config.PublishTopic, and SetDestination per message; the
		// destination key is not stored.
		h := newMW("events").Middleware(func(msg *message.Message) ([]*message.Message, error) {
			a := message.NewMessage("a-"+msg.UUID, nil)
			o := message.NewMessage("b-"+msg.UUID, nil)
			exactlyonce.SetDestination(o, "audit/log")
			o.Metadata.Set("k", "v")
			return []*message.Message{a, o}, nil
		})
		_, err := h(message.NewMessage("m1", nil))
		require.NoError(t, err)
		got := rows()
		require.Len(t, got, 2)
		require.Equal(t, []row{{"events", "a-m1", ""}, {"audit/log", "b-m1", ""}}, []row{{got[0].Topic, got[0].UUID, ""}, {got[1].Topic, got[1].UUID, ""}})
		require.JSONEq(t, "{}", got[0].Meta)
		require.JSONEq(t, `{"k": "v"}`, got[1].Meta, "the destination key is not stored")

		// Refused outputs: nothing commits (no inbox row, no outbox row),
		// and the nack waits NackDelay instead of spinning.
		for _, c := range []struct {
			name string
			out  func() []*message.Message
			want error
		}{
			{"no destination", func() []*message.Message { return []*message.Message{message.NewMessage("x", nil)} }, exactlyonce.ErrNoDestination},
			{"nil message", func() []*message.Message { return []*message.Message{nil} }, nil},
			{"metadata not UTF-8", func() []*message.Message {
				m := message.NewMessage("x", nil)
				exactlyonce.SetDestination(m, "t")
				m.Metadata.Set("bad", "\xff")
				return []*message.Message{m}
			}, nil},
			{"NUL in topic", func() []*message.Message {
				m := message.NewMessage("x", nil)
				exactlyonce.SetDestination(m, "a\x00b")
				return []*message.Message{m}
			}, nil},
		} {
			h := newMW("").Middleware(func(*message.Message) ([]*message.Message, error) { return c.out(), nil })
			before := inboxRows()
			start := time.Now()
			_, err := h(message.NewMessage("refused-"+c.name, nil))
			require.Error(t, err, c.name)
			if c.want != nil {
				require.ErrorIs(t, err, c.want, c.name)
			}
			require.GreaterOrEqual(t, time.Since(start), nackDelay, "%s: nacked after NackDelay, not at once", c.name)
			require.Equal(t, before, inboxRows(), "%s: rolled back", c.name)
			require.Len(t, rows(), 2, "%s: nothing written to the outbox", c.name)
		}
	})
}
