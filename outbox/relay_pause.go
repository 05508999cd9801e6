package outbox

import (
	"sync"
	"time"
)

// topicPauses paces the retries of a destination the broker is not taking
// messages for (its queue is full, missing or unavailable, or the broker is
// down): a topic whose rows that never failed before failed in a batch for
// reasons that are not their own, with no row of it published, is left out
// of the next batches for ErrorBackoff, doubling to MaxErrorBackoff while it
// keeps failing; a row of it published ends the pause. The rows of the
// topic keep their place and their failure counts. Other topics flow
// meanwhile: a failing destination never holds up the rows behind it, and
// when every destination fails (the broker is down) every topic is paused,
// which paces the relay as an outage backoff would.
//
// A pause is pacing, not a verdict: it never quarantines anything, and each
// Relay keeps its own.
type topicPauses struct {
	first, max time.Duration

	mu     sync.Mutex
	topics map[string]topicPause
}

type topicPause struct {
	until time.Time
	step  time.Duration
}

func newTopicPauses(first, max time.Duration) *topicPauses {
	return &topicPauses{first: first, max: max, topics: map[string]topicPause{}}
}

// active returns the topics paused now.
func (t *topicPauses) active(now time.Time) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]string, 0, len(t.topics))
	for topic, p := range t.topics {
		if now.Before(p.until) {
			out = append(out, topic)
		}
	}
	return out
}

// record updates the pauses after a batch: the topics of which a row was
// published are no longer paused; the others whose fresh rows failed for
// reasons not their own are paused, one step longer than before. It returns
// the topics it paused.
func (t *topicPauses) record(now time.Time, published, freshFailed map[string]bool) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var paused []string
	for topic := range published {
		delete(t.topics, topic)
	}
	for topic := range freshFailed {
		if published[topic] {
			continue
		}
		p, ok := t.topics[topic]
		switch {
		case !ok:
			p.step = t.first
		case now.Before(p.until):
			continue // paused meanwhile by another worker: one step per failure
		default:
			p.step = min(2*p.step, t.max)
		}
		p.until = now.Add(p.step)
		t.topics[topic] = p
		paused = append(paused, topic)
	}
	return paused
}
