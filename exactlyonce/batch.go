package exactlyonce

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlexec"
)

// Group commit (Config.Batch): the deliveries of one handler that are in
// flight at the same moment share one transaction.
//
// There is no background goroutine: the first delivery to arrive leads,
// collects the deliveries that arrived while the handler's earlier batches
// ran (batchesInFlight of a handler run at once), runs them, and hands the
// lead to the first delivery left waiting. Every delivery waits in its own
// goroutine (the router's) for its outcome, and returns it to the router,
// which acks or nacks it as with one transaction per message.
//
// A batch: BEGIN; one statement claims every key (sorted, so that batches on
// two instances cannot deadlock); the handlers of the claimed keys run in
// turn with the transaction in their context; their output messages go to
// the outbox; the statements they deferred (Exec) are sent in one round trip;
// COMMIT. When a handler fails, the transaction is rolled back and the batch
// runs again without it (its effects are all in the transaction, so running
// a handler again is safe): one failure costs its own message and a rerun,
// never the others' messages. After maxBatchReruns reruns the rest of the
// batch runs one message per transaction. A handler whose statement failed
// with a deadlock or a serialization failure (pgerr.SerializationFailure:
// a conflict with another transaction on the handler's own rows, typically
// another batch updating the same rows in another order) is not at fault:
// the batch runs again with it (logged at info level), and only after
// maxBatchReruns is its message nacked.
//
// A failure that cannot be pinned on one message, although nothing
// committed, makes the batch run again one message per transaction: a
// COMMIT the server refused (pgerr.CommitRefused: a deferred constraint, or
// a transaction that a handler aborted with a statement whose error it
// ignored), and a statement refused only because an earlier one had aborted
// the transaction (pgerr.InFailedTransaction, 25P02: the handler that got
// it may be innocent). Only a COMMIT whose outcome is unknown (a lost
// connection) nacks every message of the batch: redelivery finds what
// committed.

// maxBatchReruns bounds the reruns of one batch after handler failures.
const maxBatchReruns = 3

// batchTimeout bounds a batch's transaction, which does not end with any
// one message's context (the others' would be lost with it).
const batchTimeout = 30 * time.Second

// batcher collects the deliveries of one wrapped handler.
type batcher struct {
	m       *Guard
	h       message.HandlerFunc
	mu      sync.Mutex
	pending []*job
	leading bool          // a delivery collects the next batch
	full    chan struct{} // closed when pending reaches MaxSize (while a leader waits MaxWait)
	running chan struct{} // a slot per batch of the handler in flight (batchesInFlight)
}

// job is one delivery in a batch.
type job struct {
	msg           *message.Message
	ev            *Event
	consumer, key string
	lead          chan struct{} // closed: this delivery collects the next batch
	done          chan struct{} // closed: the outcome (ev.Outcome, err) is set
	err           error
	wait          bool // wait NackDelay before returning err
	park          bool // a Permanent handler error: park the key
	conflict      bool // failed by a conflict with another transaction (pgerr.SerializationFailure)
	copies        int  // deliveries of the key in the batch: this one and its followers
	queued        []queuedStmt
}

type queuedStmt struct {
	query string
	args  []any
}

// batchesInFlight is how many batches of one handler run at once: while
// one waits for the database (a handler's statement, the COMMIT), the next
// collects and runs, so that a batch of plain handlers (each statement a
// round trip) is not the only thing in flight.
const batchesInFlight = 2

func newBatcher(m *Guard, h message.HandlerFunc) *batcher {
	return &batcher{m: m, h: h, running: make(chan struct{}, batchesInFlight)}
}

// handleBatched runs one delivery through its handler's batcher.
func (b *batcher) handleBatched(msg *message.Message, ev *Event, consumer, key string) ([]*message.Message, error) {
	j := &job{msg: msg, ev: ev, consumer: consumer, key: key, lead: make(chan struct{}), done: make(chan struct{})}
	b.submit(j)
	if j.wait {
		sleep(msg.Context(), b.m.cfg.NackDelay)
	}
	return nil, j.err
}

// submit queues j and returns when its outcome is set, leading batches when
// its turn comes.
func (b *batcher) submit(j *job) {
	b.mu.Lock()
	b.pending = append(b.pending, j)
	first := !b.leading
	b.leading = true
	if b.full != nil && len(b.pending) >= b.m.cfg.Batch.MaxSize {
		close(b.full)
		b.full = nil
	}
	b.mu.Unlock()
	if first {
		b.lead()
	}
	lead := j.lead
	for {
		select {
		case <-j.done:
			return
		case <-lead:
			lead = nil
			b.lead()
		}
	}
}

// lead collects the next batch and runs it.
func (b *batcher) lead() {
	max := b.m.cfg.Batch.MaxSize
	if wait := b.m.cfg.Batch.MaxWait; wait > 0 {
		b.mu.Lock()
		if len(b.pending) < max {
			full := make(chan struct{})
			b.full = full
			b.mu.Unlock()
			t := time.NewTimer(wait)
			select {
			case <-full:
			case <-t.C:
			}
			t.Stop()
		} else {
			b.mu.Unlock()
		}
	}
	b.running <- struct{}{}
	defer func() { <-b.running }()
	b.mu.Lock()
	n := min(len(b.pending), max)
	batch := make([]*job, n)
	copy(batch, b.pending)
	b.pending = append([]*job(nil), b.pending[n:]...)
	b.full = nil
	if len(b.pending) > 0 {
		close(b.pending[0].lead) // it leads the next batch once this one is done
	} else {
		b.leading = false
	}
	b.mu.Unlock()
	b.run(batch)
}

// run runs a batch and sets every job's outcome.
func (b *batcher) run(jobs []*job) {
	defer func() {
		for _, j := range jobs {
			close(j.done)
		}
	}()
	for i, j := range jobs {
		j.ev.BatchSize, j.ev.BatchFirst = len(jobs), i == 0
	}
	// Copies of one key in one batch: the first runs; the others follow.
	first := map[[2]string]*job{}
	followers := map[*job][]*job{}
	var leaders []*job
	for _, j := range jobs {
		if err := j.msg.Context().Err(); err != nil {
			j.ev.Outcome = Nacked
			j.err = fmt.Errorf("exactlyonce: %q for %q: the message's context ended while it waited for its batch: %w", j.key, j.consumer, err)
			continue
		}
		k := [2]string{j.consumer, j.key}
		if f, ok := first[k]; ok {
			followers[f] = append(followers[f], j)
			continue
		}
		first[k] = j
		leaders = append(leaders, j)
	}
	for _, j := range leaders {
		// The claim counts the followers as duplicates in the key's record,
		// as their own claims would.
		j.copies = 1 + len(followers[j])
	}
	b.runJobs(leaders)
	for f, copies := range followers {
		for _, j := range copies {
			switch f.ev.Outcome {
			case Processed, Duplicate:
				j.ev.Outcome = Duplicate
				j.ev.FirstSeenAt = f.ev.FirstSeenAt
			case Parked:
				j.ev.Outcome = Parked
			default:
				j.ev.Outcome = Nacked
				j.err = fmt.Errorf("exactlyonce: %q for %q: another copy of the message in the same batch was not processed (redelivery decides): %w", j.key, j.consumer, f.err)
			}
		}
	}
}

// runJobs runs jobs in one transaction, again without each one that fails,
// and one by one after maxBatchReruns reruns. A handler whose statement
// conflicted with another transaction on the handler's own rows (a
// deadlock with another batch) is not at fault: the batch runs again with
// it, as one of those reruns; after them, a conflict nacks its message.
func (b *batcher) runJobs(jobs []*job) {
	for reruns := 0; len(jobs) > 0; reruns++ {
		group := jobs
		if reruns >= maxBatchReruns {
			group = jobs[:1]
		}
		failed := b.runOnce(group)
		if failed == errSplit {
			// Nothing committed, and the cause is one of the messages:
			// find it one message at a time.
			for _, j := range group {
				b.runJobs1(j)
			}
			jobs = jobs[len(group):]
			continue
		}
		if failed == nil {
			jobs = jobs[len(group):]
			continue
		}
		if failed.conflict {
			again := reruns < maxBatchReruns
			b.conflicted(failed, len(group), again)
			if again {
				continue
			}
		}
		// The transaction is rolled back: the failed job's key is free.
		b.parkIfPermanent(failed)
		rest := make([]*job, 0, len(jobs)-1)
		for _, j := range jobs {
			if j != failed {
				rest = append(rest, j)
			}
		}
		jobs = rest
	}
}

// errSplit is what runOnce returns when nothing of the batch committed and
// the failure cannot be pinned on one message: the server refused the
// COMMIT (pgerr.CommitRefused), or a statement was refused because an
// earlier one of another handler had aborted the transaction
// (pgerr.InFailedTransaction). The batch must run again one message per
// transaction, so that the failure costs only the message that caused it.
var errSplit = &job{}

// runJobs1 runs one job in a transaction of its own.
func (b *batcher) runJobs1(j *job) {
	if b.runOnce([]*job{j}) == j {
		if j.conflict {
			b.conflicted(j, 1, false)
		}
		b.parkIfPermanent(j)
	}
}

// conflicted logs, at info level, a batch rolled back because a handler's
// statement conflicted with another transaction on the handler's own rows
// (a deadlock between two batches that update the same rows in different
// orders, or a serialization failure): nothing of it committed, and it
// runs again (again) or, after maxBatchReruns, the message is nacked and
// redelivered, its error marked for RouterLogger.
func (b *batcher) conflicted(j *job, batch int, again bool) {
	what := "; the batch was rolled back and runs again"
	if !again {
		what = "; rolled back, the message will be redelivered"
		j.err = reported(j.err)
	}
	b.m.cfg.Logger.Info(conflictMessage+what, watermill.LogFields{
		"message_uuid": j.msg.UUID, "consumer": j.consumer, "key": j.key, "batch": batch,
		"sqlstate": pgerr.Code(j.err), "err": j.err.Error()})
}

// parkIfPermanent parks the key of a job whose handler returned a
// Permanent error, once its transaction was rolled back, keeping its
// message (parkTransactional), and acks it; if the key cannot be parked,
// the delivery stays nacked.
func (b *batcher) parkIfPermanent(j *job) {
	if !j.park {
		return
	}
	j.park = false
	if _, err := b.m.parkTransactional(j.msg, j.ev, j.err, j.consumer, j.key); err != nil {
		j.err = err
		return
	}
	j.err = nil
}

// runOnce runs jobs in one transaction. It returns the job whose handler
// (or output, or queued statement) failed, with its outcome set, after
// rolling back: the others must run again. It returns errSplit when nothing
// committed and the failure may be another job's. Otherwise every job's
// outcome is set: processed, duplicate or parked when the transaction
// committed, or nacked with the reason when the claim or the commit failed.
func (b *batcher) runOnce(jobs []*job) *job {
	m := b.m
	ctx, cancel := context.WithTimeout(context.WithoutCancel(jobs[0].msg.Context()), batchTimeout)
	defer cancel()

	var (
		tx     wsql.Tx
		claims []inboxdb.ClaimResult
		cerrs  []error
		err    error
	)
	claimStart := time.Now()
	_, claimSpan := m.tracer.Start(jobs[0].msg.Context(), "exactlyonce.claim",
		trace.WithLinks(links(jobs)...), trace.WithAttributes(attribute.Int("exactlyonce.batch_size", len(jobs))))
	for try := 1; ; try++ {
		tx, claims, cerrs, err = b.beginClaim(ctx, jobs)
		if err == nil || try == maxClaimTries || !claimAgain(err) {
			break
		}
	}
	endSpan(claimSpan, err)
	for _, j := range jobs {
		j.ev.ClaimDuration = time.Since(claimStart)
	}
	if err != nil {
		b.claimFailed(jobs, err)
		return nil
	}
	b.m.claimed()
	ended := false
	defer func() {
		if !ended {
			_ = tx.Rollback()
		}
	}()

	var run []*job
	for i, j := range jobs {
		j.err, j.wait, j.park, j.conflict = nil, false, false, false
		switch {
		case cerrs[i] != nil:
			j.ev.Outcome = Nacked
			j.err = fmt.Errorf("exactlyonce: claim of %q for %q: %w: %w", j.key, j.consumer, ErrClaimFailed, cerrs[i])
			j.wait = errors.Is(cerrs[i], inboxdb.ErrNotDone) // a configuration error
		case !claims[i].Claimed:
			rec := claims[i].Existing
			j.ev.FirstSeenAt = rec.FirstSeenAt
			j.ev.Outcome = Duplicate
			if rec.Status == inboxdb.StatusParked {
				j.ev.Outcome = Parked
			}
		default:
			run = append(run, j)
		}
	}

	th := readyTx(tx)
	ptx, pipelined := pgxOf(tx)
	var wrote *lazyOutbox // one whose rows the batch's NOTIFY is for
	for i, j := range run {
		j.queued = j.queued[:0]
		ob := &lazyOutbox{tx: th, w: m.outbox, ctx: j.msg.Context(), tracer: m.tracer}
		vals := &handlerValues{tx: th, outbox: ob, consumer: j.consumer, key: j.key}
		if pipelined {
			vals.queue = &j.queued
		}
		orig := j.msg.Context()
		j.msg.SetContext(withHandlerContext(orig, vals))
		produced, herr := m.callHandler(b.h, j.msg)
		j.msg.SetContext(orig)
		if herr == nil {
			var outputs outputSet
			if outputs, herr = m.prepareOutputs(j.msg, produced); herr == nil {
				herr = outputs.write(ob)
			}
		}
		if wrote == nil && ob.pub != nil {
			wrote = ob
		}
		if herr != nil {
			_ = tx.Rollback()
			ended = true
			if i > 0 && pgerr.InFailedTransaction(herr) {
				// An earlier handler may have aborted the transaction
				// (and ignored its statement's error).
				return errSplit
			}
			b.failed(j, herr)
			return j
		}
	}
	if pipelined {
		if j, qerr := sendQueued(ctx, ptx, run); qerr != nil {
			_ = tx.Rollback()
			ended = true
			if len(run) > 1 && pgerr.InFailedTransaction(qerr) {
				// Aborted by any handler's own statement before.
				return errSplit
			}
			b.failed(j, fmt.Errorf("exactlyonce: a statement deferred by Exec failed: %w", qerr))
			return j
		}
	}
	if wrote != nil {
		wrote.beforeCommit(ctx)
	}
	ended = true
	if err := tx.Commit(); err != nil {
		refused := pgerr.CommitRefused(err)
		if refused && len(run) > 1 {
			return errSplit
		}
		for _, j := range run {
			j.ev.Outcome = Nacked
			switch {
			case refused:
				j.err = fmt.Errorf("exactlyonce: commit of %q for %q refused by the server, nothing committed (%s), the message will be redelivered: %w",
					j.key, j.consumer, refusalCause(err), err)
			default:
				j.err = fmt.Errorf("exactlyonce: commit of a batch of %d (with %q for %q) failed, its outcome is unknown, the messages will be redelivered: %w",
					len(run), j.key, j.consumer, err)
			}
		}
		return nil
	}
	for _, j := range run {
		j.ev.Outcome = Processed
	}
	return nil
}

// beginClaim begins the batch's transaction and claims every job's key in
// it, per consumer (a handler normally has one).
func (b *batcher) beginClaim(ctx context.Context, jobs []*job) (wsql.Tx, []inboxdb.ClaimResult, []error, error) {
	tx, err := b.m.cfg.DB.Conn.BeginTx(ctx, nil)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("begin: %w", err)
	}
	claims := make([]inboxdb.ClaimResult, len(jobs))
	cerrs := make([]error, len(jobs))
	byConsumer := map[string][]int{}
	var consumers []string
	for i, j := range jobs {
		if _, ok := byConsumer[j.consumer]; !ok {
			consumers = append(consumers, j.consumer)
		}
		byConsumer[j.consumer] = append(byConsumer[j.consumer], i)
	}
	sort.Strings(consumers)
	for _, c := range consumers {
		idx := byConsumer[c]
		keys := make([]string, len(idx))
		copies := make([]int, len(idx))
		for n, i := range idx {
			keys[n], copies[n] = jobs[i].key, jobs[i].copies
		}
		res, errs, err := b.m.store.ClaimBatchCopiesTx(ctx, tx, c, keys, copies)
		if err != nil {
			_ = tx.Rollback()
			return nil, nil, nil, err
		}
		for n, i := range idx {
			claims[i], cerrs[i] = res[n], errs[n]
		}
	}
	return tx, claims, cerrs, nil
}

// claimFailed sets the outcome of every job of a batch whose claim failed
// before any handler ran (see claimFailure; group commit never fails open).
func (b *batcher) claimFailed(jobs []*job, cause error) {
	sentinel := ErrClaimFailed
	if pgerr.Unreachable(cause) {
		sentinel = ErrDBUnavailable
	} else {
		cause = pgerr.IfNotMigrated(b.m.names, cause)
	}
	for i, j := range jobs {
		j.ev.Outcome = Nacked
		err := fmt.Errorf("exactlyonce: claim of %q for %q: %w: %w", j.key, j.consumer, sentinel, cause)
		if i == 0 {
			b.m.claimFailed(err, watermill.LogFields{"batch": len(jobs), "consumer": j.consumer})
		}
		j.err = reported(err)
		j.wait = true
	}
}

// failed sets the outcome of a job whose handler, outputs or queued
// statements failed.
func (b *batcher) failed(j *job, err error) {
	j.ev.Outcome = Nacked
	j.err = err
	switch {
	case marked(err):
		j.park = true
	case isOutputError(err):
		b.m.cfg.Logger.Error("exactlyonce: the handler's output messages cannot be written, message will be redelivered", err,
			watermill.LogFields{"message_uuid": j.msg.UUID, "consumer": j.consumer, "key": j.key})
		j.wait = true
	case errors.Is(err, ErrNestedMiddleware):
		j.wait = true // logged by the inner middleware; see handlerFailed
	case pgerr.SerializationFailure(err):
		j.conflict = true // see runJobs
	}
}

// sendQueued sends the statements the jobs queued, in job order, in one
// round trip. On an error it returns the job that queued the failing
// statement.
func sendQueued(ctx context.Context, tx pgx.Tx, jobs []*job) (*job, error) {
	batch := &pgx.Batch{}
	var owners []*job
	for _, j := range jobs {
		for _, q := range j.queued {
			batch.Queue(q.query, q.args...)
			owners = append(owners, j)
		}
	}
	if len(owners) == 0 {
		return nil, nil
	}
	br := tx.SendBatch(ctx, batch)
	for _, j := range owners {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			return j, err
		}
	}
	if err := br.Close(); err != nil {
		return owners[len(owners)-1], err
	}
	return nil, nil
}

// pgxOf returns the pgx transaction behind tx, if it is one.
func pgxOf(tx wsql.Tx) (pgx.Tx, bool) {
	switch t := tx.(type) {
	case *sqlexec.PoolTx:
		return t.Pgx(), true
	case *wsql.PgxTx:
		return t.Tx, t.Tx != nil
	case wsql.PgxTx:
		return t.Tx, t.Tx != nil
	}
	return nil, false
}

// links are the process spans of a batch's deliveries, for the batch's own
// spans (a batch claim serves them all).
func links(jobs []*job) []trace.Link {
	out := make([]trace.Link, 0, len(jobs))
	for _, j := range jobs {
		if sc := trace.SpanContextFromContext(j.msg.Context()); sc.IsValid() {
			out = append(out, trace.Link{SpanContext: sc})
		}
	}
	return out
}
