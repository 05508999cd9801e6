package redisstore

import (
	"context"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

type sink struct{ got []*message.Message }

func (p *sink) Publish(_ string, msgs ...*message.Message) error {
	p.got = append(p.got, msgs...)
	return nil
}

func (p *sink) Close() error { return nil }

// TestReplayCrashBetweenSteps: a replay whose process stops after its
// first step (the key released, the message marked) leaves the key
// released with its message kept; the message is refused to other
// replays and to discards until Config.ReplayTimeout has passed, then
// replayed as usual.
func TestReplayCrashBetweenSteps(t *testing.T) {
	t.Parallel()
	c := testenv.Redis(t)
	s, err := New(Config{Client: c, Prefix: testenv.RedisPrefix(t, c), ReplayTimeout: time.Second})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	b := s.b
	claim, err := b.Claim(ctx, "c", "k", leasestore.Options{Lease: time.Minute})
	require.NoError(t, err)
	require.NoError(t, b.Fail(ctx, leasestore.Attempt{Consumer: "c", Key: "k", Token: claim.Token}, "bad", true))
	require.NoError(t, c.HSet(ctx, b.recordKey("c", "k"), "m_uuid", "u1", "m_topic", "t", "m_payload", "p", "m_size", 1,
		"m_meta", `{"order_id":"A-1"}`, "parked_at_ms", time.Now().UnixMilli()).Err())

	// The first step alone: then the process is gone.
	res, err := beginReplayScript.Run(ctx, c, b.keys("c", "k"), "k", "token-of-the-dead", ms(s.replayTimeout), "0").StringSlice()
	require.NoError(t, err)
	require.Equal(t, "ok", res[0])
	started := time.Now()

	m, err := s.GetParked(ctx, "c", "k")
	require.NoError(t, err, "the message is kept")
	require.Equal(t, "failed", m.Status, "the key is released")
	require.Equal(t, time.Duration(-1), c.PTTL(ctx, b.recordKey("c", "k")).Val(), "and does not expire meanwhile")
	page, err := s.FindParked(ctx, inbox.ParkedFilter{Consumer: "c", Metadata: map[string]string{"order_id": "A-1"}}, inbox.Page{})
	require.NoError(t, err)
	require.Len(t, page.Messages, 1, "and listed")

	pub := &sink{}
	_, err = s.ReplayParked(ctx, "c", "k", pub, inbox.ReplayOptions{})
	require.ErrorIs(t, err, inbox.ErrReplayInProgress)
	require.ErrorIs(t, s.DiscardParked(ctx, "c", "k", inbox.DiscardOptions{}), inbox.ErrReplayInProgress)
	require.Empty(t, pub.got)

	// Once the mark lapsed, a replay takes the message over.
	require.Eventually(t, func() bool {
		_, err := s.ReplayParked(ctx, "c", "k", pub, inbox.ReplayOptions{})
		return err == nil
	}, 5*time.Second, 50*time.Millisecond)
	require.GreaterOrEqual(t, time.Since(started), time.Second)
	require.Len(t, pub.got, 1)
	require.Equal(t, "u1", pub.got[0].UUID)
	_, err = s.GetParked(ctx, "c", "k")
	require.ErrorIs(t, err, inbox.ErrNotParked)

	// The dead replay's last step, should it come after all, changes
	// nothing: its mark is gone.
	n, err := finishReplayScript.Run(ctx, c, b.keys("c", "k"), "k", "token-of-the-dead", ms(b.ttl)).Int64()
	require.NoError(t, err)
	require.Zero(t, n)
}
