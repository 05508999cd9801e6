package outbox

import (
	"context"
	"fmt"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxrow"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
)

// failedRow is a row whose publish failed in this batch; permanent when
// the failure is the message's own (RelayConfig.IsPermanent).
type failedRow struct {
	id        int64
	topic     string
	uuid      string
	permanent bool
	retry     bool // the row had failed before
	err       error
}

// published is what publish did with a batch.
type published struct {
	done      []int64     // ids the publisher accepted
	failed    []failedRow // in publish order
	firstErr  error       // the first failure, with its topic
	cancelled error       // ctx ended: the rows not tried are left as they were
}

// fail records the failure of row i of b.
func (r *Relay) fail(p *published, b batch, i int, err error) {
	if p.firstErr == nil {
		p.firstErr = fmt.Errorf("outbox relay: publishing message %q to %q: %w", b.msgs[i].UUID, b.topics[i], err)
	}
	p.failed = append(p.failed, failedRow{id: b.ids[i], topic: b.topics[i], uuid: b.msgs[i].UUID, permanent: r.cfg.IsPermanent(err), retry: b.retry[i], err: err})
}

// publish hands the batch to the publisher: first the rows retried after a
// failure (they are the oldest), each in a call of its own, then the rows
// that never failed, consecutive rows of one topic in one Publish call, each
// in id order. When a call of several messages fails, they are published
// one at a time: a message the broker can never take then fails on its own
// while the others go through. A row that failed before is published alone
// for the same reason: whatever the publisher says of its error, a row that
// keeps failing never takes others down with it.
//
// Within a topic, two messages in a row, each published alone, that fail
// for reasons that are not their own, before anything of that topic was
// accepted in the batch, say its destination is not taking messages (a full
// or missing queue, the broker down): the topic's remaining rows in the
// batch are left untouched, and the other topics go on (see topicPauses
// for the batches after). A failure seen once ctx ended may be caused by the
// cancellation and is not recorded. With a BatchPublisher, the reordered
// batch goes to publishBatch instead.
func (r *Relay) publish(ctx context.Context, b batch) (p published) {
	order := make([]int, 0, len(b.msgs))
	for pass := range 2 {
		for i := range b.msgs {
			if b.retry[i] == (pass == 0) {
				order = append(order, i)
			}
		}
	}
	b = b.reordered(order)
	if r.batchPub != nil {
		return r.publishBatch(ctx, b)
	}
	// Per topic in this batch: whether a call succeeded, and the failed
	// calls of one message in a row since, for reasons not the message's
	// own; at two, the topic's destination looks unavailable (a full or
	// missing queue, or the broker down): its remaining rows are left as
	// they were, and the other topics go on.
	type topicState struct {
		accepted bool
		dead     int
	}
	topics := map[string]*topicState{}
	state := func(topic string) *topicState {
		st := topics[topic]
		if st == nil {
			st = &topicState{}
			topics[topic] = st
		}
		return st
	}
	failedAlone := func(topic string, err error) {
		if st := state(topic); !st.accepted && !r.cfg.IsPermanent(err) {
			st.dead++
		}
	}
	for start := 0; start < len(b.msgs); {
		if err := ctx.Err(); err != nil {
			p.cancelled = err
			return p
		}
		end := start + 1
		if !b.retry[start] {
			end = outboxrow.RunEnd(len(b.msgs), start, func(j int) bool {
				return b.topics[j] == b.topics[start] && !b.retry[j]
			})
		}
		topic := b.topics[start]
		if st := state(topic); !st.accepted && st.dead >= 2 {
			start = end // its destination looks unavailable
			continue
		}
		err := r.cfg.Publisher.Publish(topic, b.msgs[start:end]...)
		switch {
		case err == nil:
			p.done = append(p.done, b.ids[start:end]...)
			state(topic).accepted = true
		case ctx.Err() != nil:
			p.cancelled = ctx.Err()
			return p
		case end-start == 1:
			r.fail(&p, b, start, err)
			failedAlone(topic, err)
		default:
			// Which message failed? Each on its own (the call's failure
			// does not count: one message may have caused it).
			for j := start; j < end; j++ {
				if st := state(topic); !st.accepted && st.dead >= 2 {
					break
				}
				e := r.cfg.Publisher.Publish(topic, b.msgs[j])
				if e == nil {
					p.done = append(p.done, b.ids[j])
					state(topic).accepted = true
					continue
				}
				if ctx.Err() != nil {
					p.cancelled = ctx.Err()
					return p
				}
				r.fail(&p, b, j, e)
				failedAlone(topic, e)
			}
		}
		start = end
	}
	return p
}

// publishBatch hands the (reordered) batch to the BatchPublisher in one call;
// every message of it has an outcome. If ctx ended during the call, the
// confirmed rows are still deleted but no failure is recorded (it may have
// been caused by the cancellation).
func (r *Relay) publishBatch(ctx context.Context, b batch) (p published) {
	if len(b.msgs) == 0 {
		return p
	}
	if err := ctx.Err(); err != nil {
		p.cancelled = err
		return p
	}
	out := make([]msgid.TopicMessage, len(b.msgs))
	for i, msg := range b.msgs {
		out[i] = msgid.TopicMessage{Topic: b.topics[i], Message: msg}
	}
	errs := r.batchPub.PublishBatch(ctx, out)
	if len(errs) != len(b.msgs) {
		// A broken publisher: no message of the call counts as confirmed,
		// and nothing says they are at fault.
		bad := fmt.Errorf("%T.PublishBatch returned %d outcomes for %d messages (it must return one per message)", r.batchPub, len(errs), len(b.msgs))
		errs = make([]error, len(b.msgs))
		for i := range errs {
			errs[i] = bad
		}
	}
	for i, err := range errs {
		if err == nil {
			p.done = append(p.done, b.ids[i])
		}
	}
	if len(p.done) == len(b.msgs) {
		return p
	}
	if err := ctx.Err(); err != nil {
		p.cancelled = err
		return p
	}
	for i, err := range errs {
		if err != nil {
			r.fail(&p, b, i, err)
		}
	}
	return p
}

// quarantinedRow is a row recordFailures quarantined.
type quarantinedRow struct {
	id                 int64
	topic, uuid        string
	attempts, failures int
	lastError          string
}

// recordFailures records, in one statement (internal/outboxdb's RecordFailures), the failures of the
// batch and its unreadable rows, and returns the rows it quarantined. Each
// failed row is due again after its backoff, min(ErrorBackoff *
// 2^failures, MaxErrorBackoff); a permanent failure adds one to its
// attempts, and quarantines it when they reach MaxAttempts; an unreadable
// row is quarantined at once.
func (r *Relay) recordFailures(ctx context.Context, tx wsql.Tx, b batch, failed []failedRow) ([]quarantinedRow, error) {
	rows := make([]outboxdb.Failure, 0, len(failed)+len(b.defects))
	for _, f := range failed {
		rows = append(rows, outboxdb.Failure{ID: f.id, Permanent: f.permanent, Error: pgtext.Truncate(f.err.Error())})
	}
	for _, d := range b.defects {
		rows = append(rows, outboxdb.Failure{ID: d.id, Permanent: true, Defect: true, Error: pgtext.Truncate(d.err.Error())})
	}
	recorded, err := r.store.RecordFailures(ctx, tx, rows, outboxdb.Backoff{
		Base:        float64(r.cfg.ErrorBackoff.Microseconds()),
		Max:         float64(r.cfg.MaxErrorBackoff.Microseconds()),
		MaxAttempts: r.cfg.MaxAttempts,
	})
	if err != nil {
		return nil, fmt.Errorf("outbox relay: recording failed rows: %w", err)
	}
	var out []quarantinedRow
	for _, q := range recorded {
		if q.Quarantined {
			out = append(out, quarantinedRow{id: q.ID, topic: q.Topic, uuid: q.UUID, attempts: q.Attempts, failures: q.Failures, lastError: q.LastError})
		}
	}
	return out, nil
}

// publishInOrder publishes a batch whose rows may have ordering keys. The
// rows of one key go out one at a time, in id order, each only once the
// publisher accepted the one before: the batch is published in waves, wave
// i holding the i-th row of each key (and, in the first, every row without
// a key), each wave through publish. A row whose publish failed, or that
// was not tried, stops its key for the rest of the batch. Without two rows
// of one key, it is publish.
//
// Waves and not one call: a publisher confirms each message on its own
// (RabbitMQ may nack one and take the next, when a queue with
// x-overflow reject-publish frees room in between), so a later message of
// a key sent before the earlier one was confirmed could be taken alone.
func (r *Relay) publishInOrder(ctx context.Context, b batch) published {
	rank := make([]int, len(b.ids))
	seen := map[string]int{}
	waves := 1
	for i, k := range b.keys {
		if k == "" {
			continue
		}
		rank[i] = seen[k]
		seen[k]++
		waves = max(waves, seen[k])
	}
	if waves == 1 {
		return r.publish(ctx, b)
	}
	var all published
	stopped := map[string]bool{}
	for w := range waves {
		var idx []int
		for i, k := range b.keys {
			if rank[i] == w && (k == "" && w == 0 || k != "" && !stopped[k]) {
				idx = append(idx, i)
			}
		}
		if len(idx) == 0 {
			break
		}
		p := r.publish(ctx, b.reordered(idx))
		all.done = append(all.done, p.done...)
		all.failed = append(all.failed, p.failed...)
		if all.firstErr == nil {
			all.firstErr = p.firstErr
		}
		if p.cancelled != nil {
			all.cancelled = p.cancelled
			return all
		}
		ok := make(map[int64]bool, len(p.done))
		for _, id := range p.done {
			ok[id] = true
		}
		for _, i := range idx {
			if k := b.keys[i]; k != "" && !ok[b.ids[i]] {
				stopped[k] = true
			}
		}
	}
	return all
}
