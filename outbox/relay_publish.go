package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxrow"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

// failedRow is a row whose publish failed in this batch: sb and sa say
// whether a publish of the batch succeeded before and after its final
// failing attempt, last whether nothing was published after it.
type failedRow struct {
	id           int64
	sb, sa, last bool
	err          error
}

// published is what publish did with a batch.
type published struct {
	done      []int64     // ids the publisher accepted
	failed    []failedRow // in id order
	firstErr  error       // the first failed Publish call, with its topic
	cancelled error       // ctx ended: the rows not tried are left as they were
}

// publish hands the batch to the publisher: first the rows retried after a
// failure (they are the oldest), then the rows that never failed, each in id
// order, with consecutive rows of one topic in one Publish call. When a call
// fails, its messages are published one at a time: a message the broker can
// never take (too large, a header it refuses) then fails on its own while
// the others go through, and the rows after it show whether the broker was
// taking messages right after its failure. It goes on after failures,
// except that two failed calls of rows that never failed before, in a row,
// before anything was accepted, look like an outage: it stops there, and the
// rows not tried are left untouched. A retried row failing again says
// nothing about the broker (it may be a poison row), so it never stops the
// batch. A failure seen once ctx ended may be caused by the cancellation and
// is not recorded. With a BatchPublisher, the reordered batch goes to
// publishBatch instead.
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
	var (
		call            int // ordinal of the latest Publish call
		firstOK, lastOK int // ordinals of the first and last accepted calls, 0 if none
		deadGroups      int
	)
	type failure struct {
		i, at int
		err   error
	}
	var fails []failure
	try := func(topic string, msgs ...*message.Message) error {
		call++
		err := r.cfg.Publisher.Publish(topic, msgs...)
		if err == nil {
			if firstOK == 0 {
				firstOK = call
			}
			lastOK = call
		}
		return err
	}
outer:
	for start := 0; start < len(b.msgs); {
		if err := ctx.Err(); err != nil {
			p.cancelled = err
			break
		}
		end := outboxrow.RunEnd(len(b.msgs), start, func(j int) bool {
			return b.topics[j] == b.topics[start] && b.retry[j] == b.retry[start]
		})
		topic := b.topics[start]
		gerr := try(topic, b.msgs[start:end]...)
		if gerr == nil {
			p.done = append(p.done, b.ids[start:end]...)
			start = end
			continue
		}
		if err := ctx.Err(); err != nil {
			p.cancelled = err
			break
		}
		if p.firstErr == nil {
			p.firstErr = fmt.Errorf("outbox relay: publishing %d message(s) to %q: %w", end-start, topic, gerr)
		}
		groupOK := false
		if end-start == 1 {
			fails = append(fails, failure{start, call, gerr})
		} else {
			for j := start; j < end; j++ {
				e := try(topic, b.msgs[j])
				if e == nil {
					p.done = append(p.done, b.ids[j])
					groupOK = true
					continue
				}
				if err := ctx.Err(); err != nil {
					p.cancelled = err
					break outer
				}
				fails = append(fails, failure{j, call, e})
			}
		}
		if !groupOK && !b.retry[start] {
			deadGroups++
			if firstOK == 0 && deadGroups >= 2 {
				break // nothing gets through: an outage, most likely
			}
		}
		start = end
	}
	for _, f := range fails {
		p.failed = append(p.failed, failedRow{
			id:   b.ids[f.i],
			sb:   firstOK != 0 && firstOK < f.at,
			sa:   lastOK > f.at,
			last: f.at == call,
			err:  f.err,
		})
	}
	return p
}

// publishBatch hands the (reordered) batch to the BatchPublisher in one call
// and reads the evidence of each failure from the order of the messages in
// it: sb when a message before it was confirmed, sa when one after it was,
// last when it was the last message whose outcome is recorded. An outage
// beginning mid-call leaves its failed rows with confirms before them (sb)
// and none after, and the last of them is decided at its next attempt, as
// with the sequential publish.
//
// Every message was in flight at once, so nothing can stop early; but when
// nothing at all was confirmed (the broker looks down), the failures are
// recorded as the sequential publish would have recorded them before its
// early stop: the retried rows (they come first, and say nothing about the
// broker) and the first two runs of one topic of rows that never failed; the
// rows after those are left as they were, as rows not tried. Recording them
// all would make, in a long outage, batches of only retried rows whose last
// row carries evidence from before the outage (the accepted sequence moved
// since its previous attempt) and has its failure decided at its next
// attempt, which a broker that comes back and fails again mid-batch would
// blame on it (TestRelayBatchPublisherScenarios/OutageOnsetsBlameNoHealthyRow).
//
// If ctx ended during the call, the confirmed rows are still deleted but no
// failure is recorded (it may have been caused by the cancellation).
func (r *Relay) publishBatch(ctx context.Context, b batch) (p published) {
	if len(b.msgs) == 0 {
		return p
	}
	if err := ctx.Err(); err != nil {
		p.cancelled = err
		return p
	}
	errs := r.batchPub.PublishBatch(ctx, b.topics, b.msgs)
	if len(errs) != len(b.msgs) {
		// A broken publisher: no message of the call counts as confirmed.
		bad := fmt.Errorf("%T.PublishBatch returned %d outcomes for %d messages (it must return one per message)", r.batchPub, len(errs), len(b.msgs))
		errs = make([]error, len(b.msgs))
		for i := range errs {
			errs[i] = bad
		}
	}
	firstOK, lastOK := -1, -1 // indexes of the first and last confirmed messages
	for i, err := range errs {
		if err == nil {
			p.done = append(p.done, b.ids[i])
			if firstOK < 0 {
				firstOK = i
			}
			lastOK = i
		}
	}
	if len(p.done) == len(b.msgs) {
		return p
	}
	if err := ctx.Err(); err != nil {
		p.cancelled = err
		return p
	}
	recorded := len(errs) // the failures before this index are recorded
	if len(p.done) == 0 {
		dead := 0 // runs of rows that never failed
		for start := 0; start < len(errs); {
			end := outboxrow.RunEnd(len(errs), start, func(j int) bool {
				return b.topics[j] == b.topics[start] && b.retry[j] == b.retry[start]
			})
			if !b.retry[start] {
				if dead++; dead == 2 {
					recorded = end
					break
				}
			}
			start = end
		}
	}
	for i, err := range errs[:recorded] {
		if err == nil {
			continue
		}
		if p.firstErr == nil {
			p.firstErr = fmt.Errorf("outbox relay: publishing message %q to %q: %w", b.msgs[i].UUID, b.topics[i], err)
		}
		blameable := !unconfirmed(err)
		p.failed = append(p.failed, failedRow{
			id:   b.ids[i],
			sb:   blameable && firstOK >= 0 && firstOK < i,
			sa:   blameable && lastOK > i,
			last: blameable && i == recorded-1,
			err:  err,
		})
	}
	return p
}

// unconfirmed reports whether a BatchPublisher said that err is not the
// message's own failure (see BatchPublisher).
func unconfirmed(err error) bool {
	var u interface{ Unconfirmed() bool }
	return errors.As(err, &u) && u.Unconfirmed()
}

// quarantinedRow is a row recordFailures quarantined.
type quarantinedRow struct {
	id                 int64
	topic, uuid        string
	attempts, failures int
	lastError          string
}

// recordFailures records, in one statement, the failures of the batch and
// its unreadable rows (quarantined at once), and returns the rows it
// quarantined. For each failed row X (see RelayConfig.MaxAttempts):
//
//	gap            = a publish of this batch succeeded before X's failure, or X
//	                 failed before and the accepted sequence moved since
//	                 (fail_mark < the value read when the batch was locked)
//	attempts      += 1 if blame_pending and gap: X's previous failure, the
//	                 last publish of its batch, had a success before it, and
//	                 now one after it
//	               + 1 if something was published after X in this batch, and
//	                 gap, and a publish after X succeeded: decided now
//	blame_pending  = gap, if X was its batch's last publish (decided at X's
//	                 next attempt), else false
//	fail_mark      = the value read at lock time if a publish of this batch
//	                 succeeded after X's failure (so that it counts as after
//	                 at X's next failure), else the value now (after this
//	                 batch's nextval)
//	failures      += 1; next_attempt_at = now + backoff(failures)
//	quarantined_at = now if attempts reached MaxAttempts
func (r *Relay) recordFailures(ctx context.Context, tx wsql.Tx, b batch, failed []failedRow) ([]quarantinedRow, error) {
	n := len(failed) + len(b.defects)
	ids := make([]int64, 0, n)
	sb := make([]bool, 0, n)
	sa := make([]bool, 0, n)
	last := make([]bool, 0, n)
	defect := make([]bool, 0, n)
	texts := make([]string, 0, n)
	for _, f := range failed {
		ids, sb, sa, last, defect = append(ids, f.id), append(sb, f.sb), append(sa, f.sa), append(last, f.last), append(defect, false)
		texts = append(texts, pgtext.Truncate(f.err.Error()))
	}
	for _, d := range b.defects {
		ids, sb, sa, last, defect = append(ids, d.id), append(sb, false), append(sa, false), append(last, false), append(defect, true)
		texts = append(texts, pgtext.Truncate(d.err.Error()))
	}
	rows, err := tx.QueryContext(ctx, r.failSQL, ids, sb, sa, defect, texts, b.accepted,
		float64(r.cfg.ErrorBackoff.Microseconds()), float64(r.cfg.MaxErrorBackoff.Microseconds()), r.cfg.MaxAttempts, last)
	if err != nil {
		return nil, fmt.Errorf("outbox relay: recording failed rows: %w", err)
	}
	var out []quarantinedRow
	for rows.Next() {
		var q quarantinedRow
		var isQuarantined bool
		if err := rows.Scan(&q.id, &q.topic, &q.uuid, &q.attempts, &q.failures, &isQuarantined, &q.lastError); err != nil {
			_ = rows.Close()
			return nil, fmt.Errorf("outbox relay: recording failed rows: %w", err)
		}
		if isQuarantined {
			out = append(out, q)
		}
	}
	if err := seam.Close(rows); err != nil {
		return nil, fmt.Errorf("outbox relay: recording failed rows: %w", err)
	}
	return out, nil
}
