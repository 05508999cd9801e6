package exactlyonce

import (
	"errors"
	"sync"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// scopes notices handlers that consume one topic and record keys under
// different consumer names: copies of one handler registered several times
// for concurrency (each copy has its own name, and with the default consumer
// its own deduplication scope, so a redelivery that reaches another copy
// runs again). It warns once per topic and pair of names. It cannot tell
// such copies from distinct handlers that each must process every message
// (a fan-out), so it only warns; a Config.Consumer set explicitly silences
// it.
type scopes struct {
	mu     sync.Mutex
	first  map[string]string // subscribe topic -> first consumer name seen
	warned map[[3]string]bool
}

func (s *scopes) check(m *Guard, d *delivery) {
	if m.cfg.Consumer != "" {
		return
	}
	consumer := d.consumer
	topic := message.SubscribeTopicFromCtx(d.ctx)
	if topic == "" {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.first == nil {
		s.first = map[string]string{}
		s.warned = map[[3]string]bool{}
	}
	first, ok := s.first[topic]
	if !ok {
		s.first[topic] = consumer
		return
	}
	if first == consumer || s.warned[[3]string{topic, first, consumer}] {
		return
	}
	s.warned[[3]string{topic, first, consumer}] = true
	m.cfg.Logger.Error("exactlyonce: handlers consuming one topic record keys under different consumers", errCopies,
		watermill.LogFields{"topic": topic, "consumer": first, "other_consumer": consumer})
}

var errCopies = errors.New("if they are copies of one handler competing for one queue (registered several times for concurrency), " +
	"a redelivery that reaches another copy runs again: register the handler once with exactlyonce.ConcurrentSubscriber(sub, n), " +
	"or give the copies one Config.Consumer; if each must process every message (a fan-out), set Config.Consumer explicitly to silence this")
