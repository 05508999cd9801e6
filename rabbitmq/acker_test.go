package rabbitmq

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// brokerChannel models what RabbitMQ does with a channel's acks: a tag
// that is not outstanding (never delivered, or already acked or nacked)
// closes the channel (PRECONDITION_FAILED, unknown delivery tag), and an
// ack with multiple settles every outstanding tag up to it.
type brokerChannel struct {
	outstanding map[uint64]bool
	acked       map[uint64]bool
	nacked      map[uint64]bool
	frames      int
	err         error
}

func newBrokerChannel(n int) *brokerChannel {
	b := &brokerChannel{outstanding: map[uint64]bool{}, acked: map[uint64]bool{}, nacked: map[uint64]bool{}}
	for t := 1; t <= n; t++ {
		b.outstanding[uint64(t)] = true
	}
	return b
}

func (b *brokerChannel) Ack(tag uint64, multiple bool) error {
	b.frames++
	if b.err != nil {
		return b.err
	}
	if !b.outstanding[tag] {
		b.err = fmt.Errorf("PRECONDITION_FAILED - unknown delivery tag %d", tag)
		return b.err
	}
	if !multiple {
		delete(b.outstanding, tag)
		b.acked[tag] = true
		return nil
	}
	for t := range b.outstanding {
		if t <= tag {
			delete(b.outstanding, t)
			b.acked[t] = true
		}
	}
	return nil
}

func (b *brokerChannel) Nack(tag uint64, multiple, requeue bool) error {
	b.frames++
	if b.err != nil {
		return b.err
	}
	if multiple || !requeue {
		b.err = fmt.Errorf("unexpected nack of %d (multiple %v, requeue %v)", tag, multiple, requeue)
		return b.err
	}
	if !b.outstanding[tag] {
		b.err = fmt.Errorf("PRECONDITION_FAILED - unknown delivery tag %d", tag)
		return b.err
	}
	delete(b.outstanding, tag)
	b.nacked[tag] = true
	return nil
}

func TestAckerContiguousAcksGoOutAsOne(t *testing.T) {
	b := newBrokerChannel(64)
	a := acker{ch: b, low: 1, state: map[uint64]bool{}}
	for tag := uint64(64); tag >= 1; tag-- { // in reverse: nothing can go before tag 1
		a.record(settle{tag: tag, ack: true})
	}
	a.flush()
	require.NoError(t, b.err)
	require.Equal(t, 1, b.frames, "64 acks settled together must be one basic.ack with multiple")
	require.Len(t, b.acked, 64)
	require.Zero(t, a.held)
}

func TestAckerHoldsAcksBehindTheOldest(t *testing.T) {
	b := newBrokerChannel(10)
	a := acker{ch: b, low: 1, state: map[uint64]bool{}}
	for tag := uint64(2); tag <= 10; tag++ {
		a.record(settle{tag: tag, ack: true})
	}
	a.flush()
	require.Zero(t, b.frames, "nothing can be acked with multiple while tag 1 is in flight")
	require.Equal(t, 9, a.held)
	a.sendHeld() // AckHold passed
	require.NoError(t, b.err)
	require.Equal(t, 9, b.frames)
	require.Equal(t, map[uint64]bool{1: true}, b.outstanding)
	// Tag 1 acked at last: the prefix it opens holds only sent tags, so one
	// ack of tag 1 alone; acking tag 10 with multiple would be an unknown
	// tag for the broker.
	a.record(settle{tag: 1, ack: true})
	a.flush()
	require.NoError(t, b.err)
	require.Empty(t, b.outstanding)
	require.Equal(t, 10, b.frames)
}

func TestAckerNacksAtOnceAndAloneAndNeverAcksThem(t *testing.T) {
	b := newBrokerChannel(5)
	a := acker{ch: b, low: 1, state: map[uint64]bool{}}
	a.record(settle{tag: 3, ack: false})
	require.Equal(t, map[uint64]bool{3: true}, b.nacked, "a nack goes out at once")
	for _, tag := range []uint64{1, 2, 4, 5} {
		a.record(settle{tag: tag, ack: true})
	}
	a.flush()
	require.NoError(t, b.err)
	require.Equal(t, map[uint64]bool{1: true, 2: true, 4: true, 5: true}, b.acked)
	require.Equal(t, map[uint64]bool{3: true}, b.nacked, "the nacked delivery is not acked by the multiple ack")
	require.Equal(t, 2, b.frames)
}

// Any order of settling, with flushes and expired holds at any point: each
// delivery ends settled once, as the handler said, and the broker never sees
// an unknown tag.
func TestAckerRandomOrders(t *testing.T) {
	for seed := range uint64(300) {
		r := rand.New(rand.NewPCG(seed, 7))
		n := 1 + r.IntN(200)
		b := newBrokerChannel(n)
		a := acker{ch: b, low: 1, state: map[uint64]bool{}}
		want := map[uint64]bool{}
		order := r.Perm(n)
		for _, i := range order {
			tag := uint64(i + 1)
			ack := r.Float64() < 0.9
			want[tag] = ack
			a.record(settle{tag: tag, ack: ack})
			if r.Float64() < 0.3 {
				a.flush()
			}
			if r.Float64() < 0.05 {
				a.sendHeld()
			}
			if r.Float64() < 0.02 { // a duplicate verdict is ignored
				a.record(settle{tag: tag, ack: ack})
			}
		}
		a.flush()
		a.sendHeld()
		require.NoError(t, b.err, "seed %d", seed)
		require.Empty(t, b.outstanding, "seed %d: every delivery settled", seed)
		for tag, ack := range want {
			require.Equal(t, ack, b.acked[tag], "seed %d tag %d acked", seed, tag)
			require.Equal(t, !ack, b.nacked[tag], "seed %d tag %d nacked", seed, tag)
		}
		require.LessOrEqual(t, b.frames, n, "seed %d: at most one frame per delivery", seed)
	}
}

// Deliveries never settled (a handler that never acks, deliveries left in
// the client's buffer when consuming stopped): whatever the others do, no
// ack covers them, and the final flush (finish) sends only known tags.
func TestAckerNeverCoversUnsettled(t *testing.T) {
	for seed := range uint64(300) {
		r := rand.New(rand.NewPCG(seed, 11))
		n := 1 + r.IntN(100)
		b := newBrokerChannel(n)
		a := acker{ch: b, low: 1, state: map[uint64]bool{}}
		unsettled := map[uint64]bool{}
		for _, i := range r.Perm(n) {
			tag := uint64(i + 1)
			if r.Float64() < 0.1 {
				unsettled[tag] = true
				continue
			}
			a.record(settle{tag: tag, ack: r.Float64() < 0.9})
			if r.Float64() < 0.3 {
				a.flush()
			}
			if r.Float64() < 0.1 {
				a.sendHeld()
			}
		}
		a.flush()
		a.sendHeld()
		require.NoError(t, b.err, "seed %d", seed)
		require.Equal(t, unsettled, b.outstanding, "seed %d: exactly the unsettled deliveries stay unacknowledged", seed)
		require.Zero(t, a.held, "seed %d", seed)
	}
}
