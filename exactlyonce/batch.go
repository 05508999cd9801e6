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
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
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
//
// In code: runOnce makes one attempt at a group of jobs and returns what it
// came to (an attempt: its claims, and where it failed), setting no
// outcome; nextStep, a pure function, decides from it the batch's next step
// (settled, split, retry with the job at fault, or again without it) and
// the fates of the jobs it settles; runJobs acts on the step, and each
// job's delivery is settled once.

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
	d      *delivery
	lead   chan struct{} // closed: this delivery collects the next batch
	done   chan struct{} // closed: the delivery is settled
	copies int           // deliveries of the key in the batch: this one and its followers
	queued []queuedStmt
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

// handleBatched runs one delivery through its handler's batcher; it
// returns once the delivery is settled.
func (b *batcher) handleBatched(d *delivery) {
	b.submit(&job{d: d, lead: make(chan struct{}), done: make(chan struct{})})
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

// run runs a batch and settles every job's delivery.
func (b *batcher) run(jobs []*job) {
	defer func() {
		for _, j := range jobs {
			close(j.done)
		}
	}()
	for i, j := range jobs {
		j.d.ev.BatchSize, j.d.ev.BatchFirst = len(jobs), i == 0
	}
	// Copies of one key in one batch: the first runs; the others follow.
	first := map[[2]string]*job{}
	followers := map[*job][]*job{}
	var leaders []*job
	for _, j := range jobs {
		if err := j.d.ctx.Err(); err != nil {
			j.d.nack(fmt.Errorf("exactlyonce: %q for %q: the message's context ended while it waited for its batch: %w", j.d.key, j.d.consumer, err))
			continue
		}
		k := [2]string{j.d.consumer, j.d.key}
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
	b.runJobs(leaders, 0)
	for f, copies := range followers {
		for _, j := range copies {
			settle(j.d, followerFate(j.d, f.d))
		}
	}
}

// followerFate is the fate of a copy of a key that followed its first
// delivery in the batch (leader, settled): a duplicate of a key processed,
// parked with a key parked, nacked with one nacked (redelivery decides).
func followerFate(d, leader *delivery) fate {
	switch leader.ev.Outcome {
	case Processed, Duplicate:
		return fate{outcome: Duplicate, firstSeen: leader.ev.FirstSeenAt}
	case Parked:
		return fate{outcome: Parked}
	}
	return fate{outcome: Nacked, err: fmt.Errorf("exactlyonce: %q for %q: another copy of the message in the same batch was not processed: %w",
		d.key, d.consumer, leader.ev.Err)}
}

// runJobs runs jobs in transactions until every one is settled, as the
// policy (nextStep) says after each: all of them in one, again without
// each one that fails, and one by one after maxBatchReruns reruns (reruns
// counts the reruns so far).
func (b *batcher) runJobs(jobs []*job, reruns int) {
	for ; len(jobs) > 0; reruns++ {
		group := jobs
		if reruns >= maxBatchReruns {
			group = jobs[:1]
		}
		st := nextStep(b.runOnce(group), group, reruns)
		switch st.kind {
		case stepSettled:
			for i, j := range group {
				f := st.fates[i]
				if errors.Is(f.err, ErrDBReadOnly) {
					// A COMMIT refused by a read-only server: the
					// read-only episode logs it, not each delivery.
					f.err = b.m.readOnlyFailed(j.d, f.err)
				}
				settle(j.d, f)
			}
			jobs = jobs[len(group):]
		case stepSplit:
			// Nothing committed, and the cause is one of the messages:
			// find it one message at a time.
			for _, j := range group {
				b.runJobs([]*job{j}, maxBatchReruns)
			}
			jobs = jobs[len(group):]
		case stepRetry:
			b.conflicted(group[st.fault], st.err, len(group), true)
		case stepWithout:
			// The transaction is rolled back: the failed job's key is free.
			failed := group[st.fault]
			b.fail(failed, st.fates[st.fault], len(group))
			rest := make([]*job, 0, len(jobs)-1)
			for _, j := range jobs {
				if j != failed {
					rest = append(rest, j)
				}
			}
			jobs = rest
		}
	}
}

// fail acts on the fate of the job at fault (stepWithout): it logs what
// needs it, and parks the key of a Permanent handler error (then the
// delivery is Parked, or Nacked if the park fails) or settles the delivery.
// batch is the size of the group it ran in, for the log.
func (b *batcher) fail(j *job, f fate, batch int) {
	switch {
	case f.park:
		b.m.parkTransactional(j.d, f.err)
		return
	case f.conflict:
		b.conflicted(j, f.err, batch, false)
	case errors.Is(f.err, ErrDBReadOnly):
		f.err = b.m.readOnlyFailed(j.d, f.err)
	case isOutputError(f.err):
		b.m.cfg.Logger.Error("exactlyonce: the handler's output messages cannot be written, message will be redelivered", f.err,
			watermill.LogFields{"message_uuid": j.d.msg.UUID, "consumer": j.d.consumer, "key": j.d.key})
	}
	settle(j.d, f)
}

// settle settles d as f says (f.park aside: see batcher.fail).
func settle(d *delivery, f fate) {
	if !f.firstSeen.IsZero() {
		d.ev.FirstSeenAt = f.firstSeen
	}
	d.settle(f.outcome, f.err)
	d.wait = f.wait
}

// conflicted logs, at info level, a batch rolled back because a handler's
// statement conflicted with another transaction on the handler's own rows
// (a deadlock between two batches that update the same rows in different
// orders, or a serialization failure): nothing of it committed, and it
// runs again (again) or, after maxBatchReruns, the message is nacked and
// redelivered, its error marked for RouterLogger.
func (b *batcher) conflicted(j *job, err error, batch int, again bool) {
	what := "; the batch was rolled back and runs again"
	if !again {
		what = "; rolled back, the message will be redelivered"
	}
	b.m.cfg.Logger.Info(conflictMessage+what, watermill.LogFields{
		"message_uuid": j.d.msg.UUID, "consumer": j.d.consumer, "key": j.d.key, "batch": batch,
		"sqlstate": pgerr.Code(err), "err": err.Error()})
}

// attempt is what one transaction of a batch came to (runOnce): its claim
// and where it failed, if it did. It sets no outcome: nextStep decides
// from it.
type attempt struct {
	// claimErr: the batch's claim failed (after its retries): no handler
	// ran. claimSentinel is ErrDBUnavailable, ErrDBReadOnly or ErrClaimFailed.
	claimErr, claimSentinel error
	claims                  []inboxdb.ClaimResult // per job, when claimErr is nil
	cerrs                   []error               // per job: its own claim's error
	at                      failedAt              // where the transaction failed
	job                     int                   // the job whose handler or deferred statement failed (atHandler, atDeferred)
	err                     error                 // that failure, or the COMMIT's (atCommit)
}

// failedAt is where a batch's transaction failed, after its claim.
type failedAt int

const (
	committed  failedAt = iota // it committed
	atHandler                  // a handler, or the writing of its outputs
	atDeferred                 // a statement a handler deferred (Exec, pgx)
	atCommit                   // the COMMIT
)

// stepKind is what a batch does after an attempt (nextStep).
type stepKind int

const (
	// stepSettled: every job of the group has its fate (the transaction
	// committed, or the claim failed, or the COMMIT failed for good).
	stepSettled stepKind = iota
	// stepSplit: nothing committed and the failure cannot be pinned on one
	// job: the server refused the COMMIT (pgerr.CommitRefused), or a
	// statement was refused because an earlier one of another handler had
	// aborted the transaction (pgerr.InFailedTransaction). Each job of the
	// group runs again alone, so that the failure costs only the message
	// that caused it.
	stepSplit
	// stepRetry: a handler's statement conflicted with another transaction
	// on the handler's own rows (a deadlock with another batch): it is not
	// at fault, and the group runs again with it.
	stepRetry
	// stepWithout: the job at fault has its fate; the rest runs again
	// without it (its effects were all in the transaction, rolled back).
	stepWithout
)

// step is the policy's answer to an attempt: what the batch does next,
// and the fates it settles.
type step struct {
	kind  stepKind
	fault int    // stepRetry, stepWithout: the job at fault (index in the group)
	err   error  // stepRetry: its error, for the log
	fates []fate // stepSettled: every job's; stepWithout: fates[fault] only
}

// fate is a job's outcome as the policy decides it.
type fate struct {
	outcome   Outcome
	err       error     // returned to the router (Nacked)
	firstSeen time.Time // when its key was first recorded (a duplicate or parked key)
	wait      bool      // return err after NackDelay
	park      bool      // a Permanent handler error: park the key (then Parked, or Nacked if the park fails)
	conflict  bool      // nacked after conflicts with other transactions: logged at info level
}

// nextStep is group commit's policy: from what an attempt at group came to
// and the reruns so far, it decides what the batch does next and the fates
// of the jobs it settles. It does no I/O.
func nextStep(a attempt, group []*job, reruns int) step {
	fates := make([]fate, len(group))
	if a.claimErr != nil {
		for i, j := range group {
			fates[i] = fate{outcome: Nacked, err: reported(claimError(j.d, a.claimSentinel, a.claimErr)), wait: true}
		}
		return step{kind: stepSettled, fates: fates}
	}
	var run []int // the jobs whose handler ran (their keys claimed)
	pos := -1     // the failed job's place among them
	for i, c := range a.claims {
		switch {
		case a.cerrs[i] != nil:
			fates[i] = fate{outcome: Nacked, err: claimError(group[i].d, ErrClaimFailed, a.cerrs[i]),
				wait: errors.Is(a.cerrs[i], inboxdb.ErrNotDone)} // a configuration error
		case !c.Claimed:
			fates[i] = fate{outcome: existing(c.Existing), firstSeen: c.Existing.FirstSeenAt}
		default:
			if i == a.job {
				pos = len(run)
			}
			run = append(run, i)
		}
	}
	switch a.at {
	case atHandler, atDeferred:
		if pgerr.InFailedTransaction(a.err) && (a.at == atHandler && pos > 0 || a.at == atDeferred && len(run) > 1) {
			// An earlier handler may have aborted the transaction (and
			// ignored its statement's error).
			return step{kind: stepSplit}
		}
		f := failedFate(a.err)
		if f.conflict && reruns < maxBatchReruns {
			return step{kind: stepRetry, fault: a.job, err: a.err}
		}
		if f.conflict {
			f.err = reported(f.err)
		}
		fates := make([]fate, len(group))
		fates[a.job] = f
		return step{kind: stepWithout, fault: a.job, fates: fates}
	case atCommit:
		refused := pgerr.CommitRefused(a.err)
		if refused && len(run) > 1 {
			return step{kind: stepSplit}
		}
		for _, i := range run {
			d := group[i].d
			err := commitError(d, a.err)
			if !refused {
				err = fmt.Errorf("exactlyonce: commit of a batch of %d (with %q for %q) failed, its outcome is unknown: %w",
					len(run), d.key, d.consumer, a.err)
			}
			// A server that refuses writes refuses the next COMMIT too.
			fates[i] = fate{outcome: Nacked, err: err, wait: pgerr.ReadOnly(a.err)}
		}
		return step{kind: stepSettled, fates: fates}
	}
	for _, i := range run {
		fates[i] = fate{outcome: Processed}
	}
	return step{kind: stepSettled, fates: fates}
}

// failedFate is the fate of a job whose handler, outputs or deferred
// statement failed with err: nacked, and
//
//   - parked instead, for a Permanent error;
//   - after NackDelay, for output messages the outbox refuses (logged) and
//     for ErrNestedMiddleware (logged by the inner middleware; see
//     handlerFailed);
//   - after NackDelay, wrapping ErrDBReadOnly, for a write the server
//     refused because it is read-only (logged as the middleware's read-only
//     episode: see readOnlyFailed);
//   - as a conflict for a deadlock or serialization failure: the batch
//     runs again with it (nextStep) until maxBatchReruns.
func failedFate(err error) fate {
	f := fate{outcome: Nacked, err: err}
	switch {
	case marked(err):
		f.park = true
	case isOutputError(err), errors.Is(err, ErrNestedMiddleware):
		f.wait = true
	case pgerr.ReadOnly(err):
		// The server refuses writes (a standby): the same on every
		// redelivery until the middleware reaches the primary.
		f.err, f.wait = pgerr.IfReadOnly(err), true
	case pgerr.SerializationFailure(err):
		f.conflict = true
	}
	return f
}

// runOnce runs jobs in one transaction and returns what it came to: the
// claim, and the handler, deferred statement or COMMIT that failed, if
// any, after rolling back. It sets no outcome.
func (b *batcher) runOnce(jobs []*job) attempt {
	m := b.m
	ctx, cancel := context.WithTimeout(context.WithoutCancel(jobs[0].d.ctx), batchTimeout)
	defer cancel()

	var (
		tx     wsql.Tx
		claims []inboxdb.ClaimResult
		cerrs  []error
		err    error
	)
	claimStart := time.Now()
	_, claimSpan := m.tracer.Start(jobs[0].d.ctx, "exactlyonce.claim",
		trace.WithLinks(links(jobs)...), trace.WithAttributes(attribute.Int("exactlyonce.batch_size", len(jobs))))
	for try := 1; ; try++ {
		tx, claims, cerrs, err = b.beginClaim(ctx, jobs)
		if err == nil || try == maxClaimTries || !claimAgain(err) {
			break
		}
	}
	endSpan(claimSpan, err)
	for _, j := range jobs {
		j.d.ev.ClaimDuration = time.Since(claimStart)
	}
	if err != nil {
		sentinel, cause := b.claimFailed(jobs, err)
		return attempt{claimErr: cause, claimSentinel: sentinel}
	}
	b.m.claimed()
	a := attempt{claims: claims, cerrs: cerrs}
	ended := false
	defer func() {
		if !ended {
			_ = tx.Rollback()
		}
	}()

	var run []*job // the jobs whose keys it claimed
	var at []int   // their places in jobs
	for i, j := range jobs {
		if cerrs[i] == nil && claims[i].Claimed {
			run, at = append(run, j), append(at, i)
		}
	}

	th := readyTx(tx)
	ptx, pipelined := pgxOf(tx)
	// On MySQL the outputs are written once every handler ran and the
	// transaction is known to be open (CheckOpen): a deadlock a handler
	// ignored ends the transaction, and what runs after it commits on its
	// own; the library writes nothing then.
	mysql := m.cfg.DB.Dialect == sqlschema.MySQL
	type pending struct {
		n       int
		outputs outputSet
		ob      *lazyOutbox
	}
	var later []pending
	var wrote *lazyOutbox // one whose rows the batch's NOTIFY is for
	for n, j := range run {
		j.queued = j.queued[:0]
		ob := &lazyOutbox{tx: th, w: m.outbox, ctx: j.d.ctx, tracer: m.tracer}
		vals := &handlerValues{tx: th, outbox: ob, consumer: j.d.consumer, key: j.d.key}
		if pipelined {
			vals.queue = &j.queued
		}
		produced, herr := m.runHandler(j.d, b.h, vals)
		if herr == nil {
			var outputs outputSet
			if outputs, herr = m.prepareOutputs(j.d, produced); herr == nil {
				if mysql {
					later = append(later, pending{n, outputs, ob})
				} else {
					herr = outputs.write(ob)
				}
			}
		}
		if wrote == nil && ob.pub != nil {
			wrote = ob
		}
		if herr != nil {
			a.at, a.job, a.err = atHandler, at[n], herr
			return a
		}
	}
	if pipelined {
		if n, qerr := sendQueued(ctx, ptx, run); qerr != nil {
			a.at, a.job, a.err = atDeferred, at[n], fmt.Errorf("exactlyonce: a statement deferred by Exec failed: %w", qerr)
			return a
		}
	}
	if len(run) > 0 {
		// One claimed key tells: a rollback takes all of them.
		if err := m.store.CheckOpen(ctx, tx, run[0].d.consumer, run[0].d.key); err != nil {
			a.at, a.err = atCommit, err
			return a
		}
	}
	for _, p := range later {
		if err := p.outputs.write(p.ob); err != nil {
			a.at, a.job, a.err = atHandler, at[p.n], err
			return a
		}
		if wrote == nil && p.ob.pub != nil {
			wrote = p.ob
		}
	}
	if wrote != nil {
		wrote.beforeCommit(ctx)
	}
	ended = true
	if err := tx.Commit(); err != nil {
		a.at, a.err = atCommit, err
		return a
	}
	if wrote != nil {
		wrote.afterCommit()
	}
	return a
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
		if _, ok := byConsumer[j.d.consumer]; !ok {
			consumers = append(consumers, j.d.consumer)
		}
		byConsumer[j.d.consumer] = append(byConsumer[j.d.consumer], i)
	}
	sort.Strings(consumers)
	for _, c := range consumers {
		idx := byConsumer[c]
		keys := make([]string, len(idx))
		copies := make([]int, len(idx))
		for n, i := range idx {
			keys[n], copies[n] = jobs[i].d.key, jobs[i].copies
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

// claimFailed logs the failed claim of a batch (see claimFailure; group
// commit never fails open) and returns what every job's error wraps:
// ErrDBUnavailable, ErrDBReadOnly or ErrClaimFailed, and the cause.
func (b *batcher) claimFailed(jobs []*job, cause error) (sentinel, _ error) {
	sentinel = ErrClaimFailed
	switch {
	case pgerr.ReadOnly(cause):
		sentinel = ErrDBReadOnly
	case pgerr.Unreachable(cause):
		sentinel = ErrDBUnavailable
	default:
		cause = pgerr.IfNotMigrated(b.m.names, cause)
	}
	b.m.claimFailed(claimError(jobs[0].d, sentinel, cause), watermill.LogFields{"batch": len(jobs), "consumer": jobs[0].d.consumer})
	return sentinel, cause
}

// sendQueued sends the statements the jobs queued, in job order, in one
// round trip. On an error it returns the place in jobs of the job that
// queued the failing statement.
func sendQueued(ctx context.Context, tx pgx.Tx, jobs []*job) (int, error) {
	batch := &pgx.Batch{}
	var owners []int
	for n, j := range jobs {
		for _, q := range j.queued {
			batch.Queue(q.query, q.args...)
			owners = append(owners, n)
		}
	}
	if len(owners) == 0 {
		return -1, nil
	}
	br := tx.SendBatch(ctx, batch)
	for _, n := range owners {
		if _, err := br.Exec(); err != nil {
			_ = br.Close()
			return n, err
		}
	}
	if err := br.Close(); err != nil {
		return owners[len(owners)-1], err
	}
	return -1, nil
}

// pgxOf returns the pgx transaction behind tx, if it is one.
func pgxOf(tx wsql.Tx) (pgx.Tx, bool) { return sqlexec.TxOf(tx).Pgx() }

// links are the process spans of a batch's deliveries, for the batch's own
// spans (a batch claim serves them all).
func links(jobs []*job) []trace.Link {
	out := make([]trace.Link, 0, len(jobs))
	for _, j := range jobs {
		if sc := trace.SpanContextFromContext(j.d.ctx); sc.IsValid() {
			out = append(out, trace.Link{SpanContext: sc})
		}
	}
	return out
}
