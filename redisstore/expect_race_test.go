package redisstore_test

import (
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
)

// The Redis store checks an Expect in two steps (a read, then the action's
// script with a guard): two operators racing on one key, for real. B parks
// the key with message u1, u2, ... in turn and replays each; A reads the
// key's parked message and discards it with the version it read. Whatever
// the interleaving, a discard that succeeded deleted exactly the message
// it read: the messages B found gone (its replay met no message) are the
// ones A's successful discards read, each once, and B never replayed one
// of them.
func TestRedisExpectRacingOperators(t *testing.T) {
	t.Parallel()
	b := newParked(t, redisstore.Config{})
	const key, rounds = "k", 300
	pub := &publisher{}

	var mu sync.Mutex
	var discarded []string   // the UUIDs A's successful discards read
	var checked, guarded int // A's refusals by the check, by the script's guard
	stop := make(chan struct{})
	aDone := make(chan error, 1)
	go func() {
		for {
			select {
			case <-stop:
				aDone <- nil
				return
			default:
			}
			m, err := b.s.GetParked(b.ctx, "c", key)
			if errors.Is(err, inbox.ErrNotParked) {
				continue
			}
			if err != nil {
				aDone <- err
				return
			}
			err = b.s.DiscardParked(b.ctx, "c", key, inbox.DiscardOptions{Expect: inbox.Expect{Version: m.Version}})
			switch {
			case err == nil:
				mu.Lock()
				discarded = append(discarded, m.UUID)
				mu.Unlock()
			case errors.Is(err, inbox.ErrChanged):
				mu.Lock()
				if strings.Contains(err.Error(), "while the action was checked") {
					guarded++
				} else {
					checked++
				}
				mu.Unlock()
			case errors.Is(err, inbox.ErrNotParked), errors.Is(err, inbox.ErrReplayInProgress):
			default:
				aDone <- err
				return
			}
		}
	}()

	var gone, replayed []string
	for i := range rounds {
		uuid := fmt.Sprintf("u%03d", i)
		if st := b.status(t, "c", key); st == inboxdb.StatusDiscarded {
			_, err := b.s.Forget(b.ctx, "c", key, inbox.Expect{Status: st})
			require.NoError(t, err)
		}
		b.parkWith(t, "c", key, "declined", &inboxdb.ParkedMessage{UUID: uuid, Topic: "t", Payload: []byte("p"), Metadata: map[string]string{}})
		_, err := b.s.ReplayParked(b.ctx, "c", key, pub, inbox.ReplayOptions{Expect: inbox.Expect{MessageUUID: uuid}})
		switch {
		case err == nil:
			replayed = append(replayed, uuid)
		case errors.Is(err, inbox.ErrNotParked):
			gone = append(gone, uuid)
		default:
			require.NoError(t, err, "round %d", i)
		}
	}
	close(stop)
	require.NoError(t, <-aDone)
	mu.Lock()
	defer mu.Unlock()
	sort.Strings(discarded)
	require.Equal(t, gone, discarded, "each successful discard deleted the message it read, and only it")
	require.Len(t, pub.messages(), len(replayed))
	t.Logf("%d replayed by B, %d discarded by A; A refused %d changed at its check, %d at its script's guard",
		len(replayed), len(discarded), checked, guarded)
	require.NotEmpty(t, discarded, "the race happened")
}
