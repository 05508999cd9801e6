package exactlyonce

import (
	"errors"
	"fmt"
	"runtime/debug"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	wmiddleware "github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
)

// claimFailure settles a delivery whose claim failed with a database error
// before the handler ran (begin or claim). Only an unreachable database
// (pgerr.Unreachable) is ErrDBUnavailable and may run the handler
// fail-open; a server that refuses writes (pgerr.ReadOnly: a standby) is
// ErrDBReadOnly, any other error ErrClaimFailed, both always a nack after
// NackDelay: the database is there, and another copy may be running the
// key.
func (m *Guard) claimFailure(d *delivery, h message.HandlerFunc, cause error) {
	fields := watermill.LogFields{"message_uuid": d.msg.UUID, "consumer": d.consumer, "key": d.key}
	if pgerr.ReadOnly(cause) {
		err := claimError(d, ErrDBReadOnly, cause)
		m.claimFailed(err, fields)
		d.nackLater(reported(err))
		return
	}
	if !m.unreachable(cause) {
		err := claimError(d, ErrClaimFailed, pgerr.IfNotMigrated(m.names, cause))
		m.claimFailed(err, fields)
		d.nackLater(reported(err))
		return
	}
	err := claimError(d, ErrDBUnavailable, cause)
	if !m.cfg.FailOpen || m.cfg.Lease != nil || d.ctx.Err() != nil {
		m.claimFailed(err, fields)
		d.nackLater(reported(err))
		return
	}
	m.episodes.Fail(episodeFailOpen, "exactlyonce: FAIL-OPEN: the database is unavailable, handlers run without deduplication", err, fields)
	produced, herr := m.runHandler(d, h, &handlerValues{consumer: d.consumer, key: d.key, failOpen: true})
	if herr == nil {
		d.out, herr = m.failOpenOutputs(d, produced)
	}
	d.settle(FailOpen, herr)
}

// The kinds of the middleware's episodes (see internal/episode): failures
// that repeat for one cause are logged when they start, every
// episode.DefaultInterval while they go on, and when they end.
const (
	episodeUnavailable = "unavailable"
	episodeNotMigrated = "not-migrated"
	episodeClaim       = "claim"
	episodeReadOnly    = "read-only"
	episodeFailOpen    = "fail-open"
)

// claimFailed logs a claim that failed before any handler ran (err wraps
// ErrDBUnavailable, ErrDBReadOnly or ErrClaimFailed) as part of its
// episode; also a handler's write or a COMMIT refused because the server is
// read-only (ErrDBReadOnly).
func (m *Guard) claimFailed(err error, fields watermill.LogFields) {
	switch {
	case errors.Is(err, ErrDBReadOnly):
		m.episodes.Fail(episodeReadOnly, "exactlyonce: the database refuses writes (a standby, or a read-only server or transaction): "+
			"messages are nacked and redelivered until the middleware reaches the primary "+
			"(connect to it, e.g. target_session_attrs=read-write in a multi-host URL, or through a proxy that follows it)", err, fields)
	case errors.Is(err, ErrDBUnavailable):
		what := "exactlyonce: database unavailable, messages are nacked and redelivered until it is back"
		if m.lease != nil && !m.lease.Transactional() {
			what = "exactlyonce: the lease store is unavailable, messages are nacked and redelivered until it is back"
		}
		m.episodes.Fail(episodeUnavailable, what, err, fields)
	case errors.Is(err, pgerr.ErrNotMigrated):
		m.episodes.Fail(episodeNotMigrated, "exactlyonce: the inbox table is not migrated, messages are nacked and redelivered until it is (run 'exactlyonce migrate up' or sqlschema.Migrate)", err, fields)
	default:
		m.episodes.Fail(episodeClaim, "exactlyonce: claims are failing, messages are nacked and redelivered", err, fields)
	}
}

// claimed ends the episodes a successful claim shows are over.
func (m *Guard) claimed() {
	m.episodes.End(episodeUnavailable, episodeNotMigrated, episodeClaim, episodeReadOnly, episodeFailOpen)
	if m.check.pending.Load() {
		m.check.due.Store(true)
	}
}

// reportedError marks an error the middleware returns to the router after
// logging it itself (as part of an episode), or that is expected (a lease
// held by another worker): RouterLogger logs it at debug level.
type reportedError struct{ error }

func (e reportedError) Unwrap() error { return e.error }

func reported(err error) error { return reportedError{err} }

// unreachable reports whether cause means the store could not be reached:
// lease mode asks its store, transactional mode pgerr.
func (m *Guard) unreachable(cause error) bool {
	if m.lease != nil {
		return m.lease.Unreachable(cause)
	}
	return pgerr.Unreachable(cause)
}

// failOpenOutputs returns the fail-open handler's messages to the router,
// which publishes them to the handler's publish topic. A message meant for
// another topic (SetDestination, or a Config.PublishTopic that differs) has
// no way out without the outbox: the delivery fails (nack) rather than
// publish it to the wrong topic or drop it. The internal destination key
// never reaches the router.
func (m *Guard) failOpenOutputs(d *delivery, produced []*message.Message) ([]*message.Message, error) {
	if len(produced) == 0 {
		return nil, nil
	}
	routerTopic := message.PublishTopicFromCtx(d.ctx)
	defaultTopic := m.defaultTopic(d.ctx)
	out := make([]*message.Message, 0, len(produced))
	for i, p := range produced {
		topic, err := destination(p, i, defaultTopic)
		if err != nil {
			return nil, err
		}
		if routerTopic == "" || topic != routerTopic {
			return nil, fmt.Errorf("exactlyonce: %w: fail-open: message %q is for topic %q, not the handler's publish topic %q",
				ErrNoDestination, p.UUID, topic, routerTopic)
		}
		out = append(out, p)
	}
	return out, nil
}

// recoverHandler runs h and turns a panic into Watermill's
// middleware.RecoveredPanicError (the value and the stack), wrapped.
func recoverHandler(h message.HandlerFunc, msg *message.Message) (produced []*message.Message, err error) {
	panicked := true
	defer func() {
		if r := recover(); r != nil || panicked {
			err = fmt.Errorf("exactlyonce: handler panicked: %w", wmiddleware.RecoveredPanicError{V: r, Stacktrace: string(debug.Stack())})
		}
	}()
	produced, err = h(msg)
	panicked = false
	return produced, err
}

func isOutputError(err error) bool {
	return errors.Is(err, errOutput) || errors.Is(err, ErrNoDestination)
}
