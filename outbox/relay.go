package outbox

import (
	"context"
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// RelayConfig configures a Relay. DB and Publisher are required.
type RelayConfig struct {
	// DB starts the relay's transactions: sql.BeginnerFromPgx(pool) or
	// sql.BeginnerFromStdSQL(db) from watermill-sql. Required. The relay's
	// transactions are READ COMMITTED whatever the database's default.
	DB wsql.Beginner

	// Publisher receives the messages, with each row's topic. It must return
	// only once the broker has the messages (for watermill-amqp: set
	// ConfirmDelivery). Required.
	Publisher message.Publisher

	// Tables names the outbox table. Defaults to sqlschema's defaults.
	Tables sqlschema.Config

	// BatchSize is the most rows one transaction locks, publishes and
	// deletes. Defaults to 100.
	BatchSize int

	// Workers is the number of batches relayed concurrently by this Relay,
	// each in its own transaction. Defaults to 1.
	Workers int

	// PollInterval is the wait after a poll that found less than a full
	// batch. A full batch of which something was published is followed at
	// once by the next. Defaults to 100ms.
	PollInterval time.Duration

	// ErrorBackoff is the first wait of Run after a batch in which publishes
	// failed and none succeeded (the broker looks down); it doubles with
	// each such batch in a row up to MaxErrorBackoff. It also paces the
	// retries of a failing row: after its k-th failed publish a row is
	// skipped for min(ErrorBackoff * 2^(k-1), MaxErrorBackoff), while the
	// rows behind it are relayed. Defaults to 500ms.
	ErrorBackoff time.Duration

	// MaxErrorBackoff caps ErrorBackoff, for Run and for a failing row's
	// retries. Defaults to 15s.
	MaxErrorBackoff time.Duration

	// MaxAttempts quarantines a row once this many of its failures were
	// blamed on it. A failure of a row counts against it only when the
	// broker accepted other messages both before it (since the row's
	// previous attempt, or earlier in the same batch) and right after it:
	// later in the same batch, or, when nothing was published after it in
	// its batch, before the row's next attempt. The evidence across batches
	// is shared by every relay of the table (a sequence advanced once per
	// batch the broker accepted something from), so it holds for
	// BatchSize 1 and several instances.
	//
	// So a message the broker can never take (too large, a header it
	// refuses) among rows that flow is blamed from its second failure on
	// and quarantined after MaxAttempts+1 or +2 failures, while an outage,
	// even one beginning in the middle of a batch, blames no row: the rows
	// published after a failed one fail too, and its next attempt either
	// fails again with nothing accepted in between or goes through.
	// If nothing else is ever published (the outbox holds only rows the
	// broker refuses), nothing can be proven: those rows keep being retried
	// with capped backoff, reported by PendingStats.Failing, blocking
	// nothing. A row whose metadata cannot be decoded is quarantined at
	// once. A quarantined row is skipped and logged; PendingStats reports it
	// and RequeueFailed puts it back. Defaults to 5.
	MaxAttempts int

	// Logger logs failed batches and quarantined rows. Defaults to no
	// logging.
	Logger watermill.LoggerAdapter
}

// WithDefaults returns a copy of c with empty fields set to their defaults.
func (c RelayConfig) WithDefaults() RelayConfig {
	c.Tables = c.Tables.WithDefaults()
	if c.BatchSize == 0 {
		c.BatchSize = 100
	}
	if c.Workers == 0 {
		c.Workers = 1
	}
	if c.PollInterval == 0 {
		c.PollInterval = 100 * time.Millisecond
	}
	if c.ErrorBackoff == 0 {
		c.ErrorBackoff = 500 * time.Millisecond
	}
	if c.MaxErrorBackoff == 0 {
		c.MaxErrorBackoff = 15 * time.Second
	}
	if c.Logger == nil {
		c.Logger = watermill.NopLogger{}
	}
	if c.MaxAttempts == 0 {
		c.MaxAttempts = 5
	}
	return c
}

func (c RelayConfig) validate() error {
	switch {
	case c.DB == nil:
		return errors.New("outbox: RelayConfig.DB is required")
	case c.Publisher == nil:
		return errors.New("outbox: RelayConfig.Publisher is required")
	case c.BatchSize < 1 || c.BatchSize > 10000:
		return fmt.Errorf("outbox: RelayConfig.BatchSize is %d, it must be between 1 and 10000", c.BatchSize)
	case c.MaxAttempts < 1:
		return fmt.Errorf("outbox: RelayConfig.MaxAttempts is %d, it must be >= 1", c.MaxAttempts)
	case c.Workers < 1:
		return fmt.Errorf("outbox: RelayConfig.Workers is %d, it must be >= 1", c.Workers)
	case c.PollInterval < 0 || c.ErrorBackoff < 0 || c.MaxErrorBackoff < c.ErrorBackoff:
		return errors.New("outbox: RelayConfig: PollInterval and ErrorBackoff must be >= 0 and MaxErrorBackoff >= ErrorBackoff")
	}
	if err := c.Tables.Validate(); err != nil {
		return fmt.Errorf("outbox: RelayConfig.Tables: %w", err)
	}
	return nil
}

// Relay moves outbox rows to a publisher. Several Relays (in one process or
// many) may run against one table: each batch is locked with SKIP LOCKED.
type Relay struct {
	cfg         RelayConfig
	selectSQL   string
	deleteSQL   string
	failSQL     string
	relayed     atomic.Int64
	batches     atomic.Int64
	failures    atomic.Int64
	quarantined atomic.Int64
	lastErrMu   sync.Mutex
	lastErr     error
	runningMux  sync.Mutex
}

// NewRelay validates cfg and returns a Relay. The outbox table must exist,
// migrated by sqlschema.Migrate to its latest version (outbox_003).
func NewRelay(cfg RelayConfig) (*Relay, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	table := cfg.Tables.Outbox()
	seq := cfg.Tables.OutboxAcceptedSequence()
	// The number of nextval calls so far: last_value is the start value
	// (1) both before the first call and after it, is_called tells them
	// apart. Sequences are not transactional: this is the value now.
	accepted := `(SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM ` + seq + `)`
	return &Relay{
		cfg: cfg,
		selectSQL: `SELECT id, topic, uuid, payload, metadata::text, failures > 0, ` + accepted + ` FROM ` + table +
			` WHERE quarantined_at IS NULL AND (next_attempt_at IS NULL OR next_attempt_at <= now())` +
			` ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED`,
		// One round trip deletes the relayed rows and records that the
		// broker accepted something (the table names are validated plain
		// identifiers: no quote can end the literal).
		deleteSQL: `WITH d AS (DELETE FROM ` + table + ` WHERE id = ANY($1) RETURNING 1)` +
			` SELECT nextval('` + seq + `'), (SELECT count(*) FROM d)`,
		failSQL: `WITH f AS (
  SELECT * FROM unnest($1::bigint[], $2::boolean[], $3::boolean[], $4::boolean[], $5::text[], $10::boolean[])
    AS f(id, sb, sa, defect, err, last)
), g AS (
  SELECT o.id, f.sa, f.defect, f.err, f.last,
         f.sb OR (o.failures > 0 AND coalesce(o.fail_mark < $6, false)) AS gap
  FROM ` + table + ` o JOIN f ON f.id = o.id
), h AS (
  SELECT g.*, CASE WHEN g.defect THEN 0 ELSE
           (CASE WHEN o.blame_pending AND g.gap THEN 1 ELSE 0 END) +
           (CASE WHEN NOT g.last AND g.gap AND g.sa THEN 1 ELSE 0 END) END AS blamed
  FROM g JOIN ` + table + ` o ON o.id = g.id
)
UPDATE ` + table + ` o SET
  attempts = o.attempts + h.blamed,
  blame_pending = h.last AND h.gap AND NOT h.defect,
  fail_mark = CASE WHEN h.sa THEN $6 ELSE ` + accepted + ` END,
  failures = o.failures + 1,
  next_attempt_at = clock_timestamp() + least($7::float8 * power(2::float8, least(o.failures, 62)), $8::float8) * interval '1 microsecond',
  last_error = h.err,
  quarantined_at = CASE WHEN h.defect OR o.attempts + h.blamed >= $9 THEN clock_timestamp() END
FROM h WHERE o.id = h.id
RETURNING o.id, o.topic, o.uuid, o.attempts, o.failures, o.quarantined_at IS NOT NULL, coalesce(o.last_error, '')`,
	}, nil
}

// RelayStats are counters since the Relay was created.
type RelayStats struct {
	// Relayed is the number of messages published and deleted.
	Relayed int64
	// Batches is the number of committed batches that relayed a message or
	// recorded a failure (an empty poll is not a batch).
	Batches int64
	// Failures is the number of RelayOnce calls (batches) that returned an
	// error: a publish failed, a row was quarantined, or the database
	// failed. Errors caused by the context ending are not counted.
	Failures int64
	// Quarantined is the number of rows this Relay quarantined: their
	// failures blamed on them reached MaxAttempts, or their metadata could
	// not be decoded. Each is also logged at Error level.
	Quarantined int64
	// LastError is the error of the latest failed batch, nil if none.
	LastError error
}

// Stats returns the Relay's counters.
func (r *Relay) Stats() RelayStats {
	r.lastErrMu.Lock()
	defer r.lastErrMu.Unlock()
	return RelayStats{
		Relayed:     r.relayed.Load(),
		Batches:     r.batches.Load(),
		Failures:    r.failures.Load(),
		Quarantined: r.quarantined.Load(),
		LastError:   r.lastErr,
	}
}

// Run relays until ctx is done, then returns nil after the batches in
// flight finished (each either committed or rolled back). Errors are
// logged, not returned. A batch of which something was published is
// followed at once by the next if it was full; a batch in which publishes
// failed and none succeeded (the broker looks down) is followed by a wait
// of ErrorBackoff, doubling to MaxErrorBackoff while it lasts. Rows that
// failed wait out their own backoff (see RelayConfig.ErrorBackoff) while
// the rows behind them are relayed. Run may be called once at a time per
// Relay.
func (r *Relay) Run(ctx context.Context) error {
	if !r.runningMux.TryLock() {
		return errors.New("outbox: Relay.Run is already running")
	}
	defer r.runningMux.Unlock()

	var wg sync.WaitGroup
	for range r.cfg.Workers {
		wg.Go(func() { r.work(ctx) })
	}
	wg.Wait()
	return nil
}

func (r *Relay) work(ctx context.Context) {
	backoff := r.cfg.ErrorBackoff
	for ctx.Err() == nil {
		res, err := r.relayBatch(ctx)
		var wait time.Duration
		switch {
		case err != nil && ctx.Err() != nil:
			return
		case err != nil && res.relayed == 0 && (res.failed > 0 || res.defects == 0):
			// Nothing went through: the broker (or the database) looks down.
			r.cfg.Logger.Error("outbox relay: batch failed, will retry", err, watermill.LogFields{"backoff": backoff.String()})
			wait = backoff
			backoff = min(2*backoff, r.cfg.MaxErrorBackoff)
		default:
			if err != nil {
				r.cfg.Logger.Error("outbox relay: rows failed, each is retried after its own backoff", err, watermill.LogFields{
					"relayed": res.relayed, "failed": res.failed, "quarantined": res.quarantined,
				})
			}
			backoff = r.cfg.ErrorBackoff
			if res.locked == r.cfg.BatchSize {
				continue
			}
			wait = r.cfg.PollInterval
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// finishTimeout bounds the DELETE and UPDATE that follow a publish. It does
// not depend on the caller's context: once the broker has a batch, deleting
// its rows is worth finishing even while the relay shuts down.
const finishTimeout = 30 * time.Second

// RelayOnce relays at most one batch in one transaction and returns how
// many messages it published and deleted. The batch is the first BatchSize
// rows in id order that are neither quarantined nor waiting out the backoff
// of an earlier failure. They are published in id order, consecutive rows
// of one topic in one Publish call; when a call fails, its messages are
// published one at a time, so that a message the broker can never take
// fails on its own, and the rest of the batch is still published. Only when
// two calls in a row fail before anything of the batch was accepted (the
// broker looks down) does it stop early, leaving the rows not tried as they
// were.
//
// In the same transaction, the rows the publisher accepted are deleted, and
// each row that failed has its failure recorded: it is skipped until its
// backoff ends (see RelayConfig.ErrorBackoff), and quarantined when the
// failures blamed on it reach RelayConfig.MaxAttempts (see there for the
// rule). A row whose metadata cannot be decoded is quarantined at once. The
// error returned, if any, describes the failures; the count is still that
// of the rows relayed. A crash (or a failed commit) after a publish leaves
// rows that were sent: they are sent again later (at-least-once).
//
// Cancelling ctx stops RelayOnce before the next poll or publish, but what
// the publisher already accepted is still deleted and committed. An error
// caused by ctx ending is not counted in Stats().Failures.
func (r *Relay) RelayOnce(ctx context.Context) (n int, err error) {
	res, err := r.relayBatch(ctx)
	return res.relayed, err
}

// batchResult is what one batch did.
type batchResult struct {
	locked      int // rows locked, including unreadable ones
	relayed     int // rows published and deleted
	failed      int // rows whose publish failed, recorded
	defects     int // rows quarantined at once (unreadable metadata)
	quarantined int // rows quarantined, defects included
}

func (r *Relay) relayBatch(ctx context.Context) (res batchResult, err error) {
	defer func() {
		if err != nil && ctx.Err() == nil {
			r.failures.Add(1)
			r.lastErrMu.Lock()
			r.lastErr = err
			r.lastErrMu.Unlock()
		}
	}()
	// The transaction outlives ctx (database/sql would roll it back on
	// cancel, and pgx commits with the context it began with). It is READ
	// COMMITTED whatever the default: under REPEATABLE READ, SKIP LOCKED
	// meeting a row another relay deleted after the snapshot fails (40001).
	tx, err := r.cfg.DB.BeginTx(context.WithoutCancel(ctx), &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return res, fmt.Errorf("outbox relay: begin: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()

	b, err := r.lockBatch(ctx, tx)
	if err != nil {
		return res, err
	}
	res.locked = len(b.ids) + len(b.defects)
	if res.locked == 0 {
		if err := tx.Commit(); err != nil {
			return res, fmt.Errorf("outbox relay: commit: %w", err)
		}
		committed = true
		return res, nil
	}
	p := r.publish(ctx, b)
	if len(p.done) == 0 && len(p.failed) == 0 && len(b.defects) == 0 {
		return res, p.cancelled // cancelled before the first publish: nothing to record
	}

	finishCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
	defer cancel()
	if len(p.done) > 0 {
		if _, err := tx.ExecContext(finishCtx, r.deleteSQL, p.done); err != nil {
			return res, fmt.Errorf("outbox relay: deleting relayed rows: %w", err)
		}
	}
	var quarantined []quarantinedRow
	if len(p.failed) > 0 || len(b.defects) > 0 {
		quarantined, err = r.recordFailures(finishCtx, tx, b, p.failed)
		if err != nil {
			return res, err
		}
	}
	if err := tx.Commit(); err != nil {
		return res, fmt.Errorf("outbox relay: commit: %w", err)
	}
	committed = true
	r.relayed.Add(int64(len(p.done)))
	r.batches.Add(1)
	r.quarantined.Add(int64(len(quarantined)))
	for _, q := range quarantined {
		r.cfg.Logger.Error("outbox relay: row quarantined; it is skipped until outbox.RequeueFailed",
			errors.New(q.lastError), watermill.LogFields{
				"id": q.id, "topic": q.topic, "uuid": q.uuid, "blamed_failures": q.attempts, "failures": q.failures,
			})
	}
	res.relayed, res.failed, res.defects, res.quarantined = len(p.done), len(p.failed), len(b.defects), len(quarantined)
	return res, r.batchError(b, p, res)
}

// batchError describes what failed in a committed batch, nil if nothing.
func (r *Relay) batchError(b batch, p published, res batchResult) error {
	var errs []error
	if len(b.defects) > 0 {
		errs = append(errs, fmt.Errorf("outbox relay: %d row(s) quarantined at once: %w", len(b.defects), b.defects[0].err))
	}
	if p.firstErr != nil {
		var note []string
		if res.relayed > 0 {
			note = append(note, fmt.Sprintf("%d published", res.relayed))
		}
		note = append(note, fmt.Sprintf("%d failed and wait for a retry", res.failed))
		if q := res.quarantined - res.defects; q > 0 {
			note = append(note, fmt.Sprintf("%d quarantined after %d blamed failures", q, r.cfg.MaxAttempts))
		}
		errs = append(errs, fmt.Errorf("%w (%s)", p.firstErr, strings.Join(note, ", ")))
	}
	if p.cancelled != nil {
		errs = append(errs, p.cancelled)
	}
	switch len(errs) {
	case 0:
		return nil
	case 1:
		return errs[0]
	default:
		return joinedError(errs)
	}
}

// joinedError is errors.Join on one line.
type joinedError []error

func (e joinedError) Error() string {
	parts := make([]string, len(e))
	for i, err := range e {
		parts[i] = err.Error()
	}
	return strings.Join(parts, "; ")
}

func (e joinedError) Unwrap() []error { return e }

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
// is not recorded.
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
		end := start + 1
		for end < len(b.msgs) && b.topics[end] == b.topics[start] && b.retry[end] == b.retry[start] {
			end++
		}
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
		texts = append(texts, pgtext.Storable(f.err.Error(), maxErrorText))
	}
	for _, d := range b.defects {
		ids, sb, sa, last, defect = append(ids, d.id), append(sb, false), append(sa, false), append(last, false), append(defect, true)
		texts = append(texts, pgtext.Storable(d.err.Error(), maxErrorText))
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

// maxErrorText bounds the last_error stored on a failing row.
const maxErrorText = 2000

// batch is a locked batch: the rows to publish, in id order, and the rows
// whose metadata cannot be decoded.
type batch struct {
	ids      []int64
	topics   []string
	msgs     []*message.Message
	retry    []bool // the row failed before
	defects  []defect
	accepted int64 // the accepted sequence's value when the batch was locked
}

// reordered returns the batch's rows in the given order (indexes into b).
func (b batch) reordered(order []int) batch {
	out := batch{defects: b.defects, accepted: b.accepted,
		ids: make([]int64, len(order)), topics: make([]string, len(order)),
		msgs: make([]*message.Message, len(order)), retry: make([]bool, len(order))}
	for j, i := range order {
		out.ids[j], out.topics[j], out.msgs[j], out.retry[j] = b.ids[i], b.topics[i], b.msgs[i], b.retry[i]
	}
	return out
}

type defect struct {
	id  int64
	err error
}

func (r *Relay) lockBatch(ctx context.Context, tx wsql.Tx) (batch, error) {
	rows, err := tx.QueryContext(ctx, r.selectSQL, r.cfg.BatchSize)
	if err != nil {
		return batch{}, fmt.Errorf("outbox relay: selecting batch: %w", err)
	}
	var b batch
	for rows.Next() {
		var (
			id      int64
			topic   string
			uuid    string
			payload []byte
			meta    string
			retry   bool
		)
		if err := rows.Scan(&id, &topic, &uuid, &payload, &meta, &retry, &b.accepted); err != nil {
			_ = rows.Close()
			return batch{}, fmt.Errorf("outbox relay: reading batch: %w", err)
		}
		msg := message.NewMessage(uuid, payload)
		if err := json.Unmarshal([]byte(meta), &msg.Metadata); err != nil {
			// No retry can fix it: quarantined at once, the rest goes on.
			b.defects = append(b.defects, defect{id, fmt.Errorf("row %d (topic %q, uuid %q) has unreadable metadata: %w", id, topic, uuid, err)})
			continue
		}
		if msg.Metadata == nil {
			msg.Metadata = message.Metadata{}
		}
		msg.SetContext(ctx)
		b.ids = append(b.ids, id)
		b.topics = append(b.topics, topic)
		b.msgs = append(b.msgs, msg)
		b.retry = append(b.retry, retry)
	}
	if err := seam.Close(rows); err != nil {
		return batch{}, fmt.Errorf("outbox relay: reading batch: %w", err)
	}
	return b, nil
}

// Pending describes the outbox backlog.
type Pending struct {
	// Count is the number of rows not relayed yet, quarantined ones
	// included.
	Count int64
	// OldestCreatedAt is the creation time of the oldest row not
	// quarantined: the lag of the live stream. Nil when there is none.
	OldestCreatedAt *time.Time
	// OldestAge is now() - OldestCreatedAt as the database sees it; zero
	// when there is no such row. Alert on it.
	OldestAge time.Duration
	// Failing counts rows not quarantined whose publish failed at least
	// once: they are retried with backoff, without blocking the rows behind
	// them. A steady number means a broker problem or rows the broker
	// refuses; read their last_error column.
	Failing int64
	// Quarantined counts rows the relay gave up on (see
	// RelayConfig.MaxAttempts): skipped until RequeueFailed. Alert on it,
	// read their last_error, fix the cause, then RequeueFailed.
	Quarantined int64
}

// PendingStats reports the backlog of the outbox table named by tables. The
// count scans the table, which holds only unrelayed rows.
func PendingStats(ctx context.Context, db wsql.ContextExecutor, tables sqlschema.Config) (Pending, error) {
	if err := tables.Validate(); err != nil {
		return Pending{}, err
	}
	var p Pending
	var ageSeconds *float64
	err := seam.QueryRow(ctx, db,
		`SELECT count(*),
       min(created_at) FILTER (WHERE quarantined_at IS NULL),
       extract(epoch FROM now() - min(created_at) FILTER (WHERE quarantined_at IS NULL))::float8,
       count(*) FILTER (WHERE failures > 0 AND quarantined_at IS NULL),
       count(*) FILTER (WHERE quarantined_at IS NOT NULL)
FROM `+tables.Outbox(),
		nil, &p.Count, &p.OldestCreatedAt, &ageSeconds, &p.Failing, &p.Quarantined)
	if err != nil {
		return Pending{}, fmt.Errorf("outbox: pending stats: %w", err)
	}
	if ageSeconds != nil {
		p.OldestAge = time.Duration(*ageSeconds * float64(time.Second))
	}
	return p, nil
}

// RequeueFailed clears the failure record of every outbox row in tables
// that has one (failures and blamed failures, backoff, quarantine, last
// error), so that quarantined rows are relayed again and failing rows are
// due at once. Use it after fixing the cause. It returns the number of rows
// cleared.
func RequeueFailed(ctx context.Context, db wsql.ContextExecutor, tables sqlschema.Config) (int64, error) {
	if err := tables.Validate(); err != nil {
		return 0, err
	}
	n, err := seam.Exec(ctx, db, `UPDATE `+tables.Outbox()+` SET failures = 0, attempts = 0, next_attempt_at = NULL,
  blame_pending = false, fail_mark = NULL, quarantined_at = NULL, last_error = NULL
WHERE failures > 0 OR attempts > 0 OR quarantined_at IS NOT NULL OR next_attempt_at IS NOT NULL`)
	if err != nil {
		return 0, fmt.Errorf("outbox: requeue failed rows: %w", err)
	}
	return n, nil
}
