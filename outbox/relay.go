package outbox

import (
	"context"
	stdsql "database/sql"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/exactlyonce/watermill-exactlyonce/internal/episode"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlexec"
	"github.com/exactlyonce/watermill-exactlyonce/internal/tracing"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// ErrDBReadOnly is what the relay's errors (Stats().LastError, Flush's)
// wrap when the database took the connection but refuses writes: the
// relay reaches a standby (a hot standby, a replica) or a read-only server,
// where its batch cannot lock rows (SELECT ... FOR UPDATE is a write).
// Nothing is published, nothing is counted against the rows; Run logs it
// as one episode ("outbox relay: the database is read-only") and tries
// again every MaxErrorBackoff, and goes on by itself once its connections
// reach a primary (a standby promoted in place, or a multi-host URL with
// target_session_attrs=read-write). It is exactlyonce.ErrDBReadOnly.
var ErrDBReadOnly = pgerr.ErrDBReadOnly

// Relay moves outbox rows to a publisher. Several Relays (in one process or
// many) may run against one table: each batch is locked with SKIP LOCKED.
type Relay struct {
	cfg         RelayConfig
	batchPub    BatchPublisher  // cfg.Publisher, when it implements BatchPublisher
	store       *outboxdb.Store // the table's statements
	conn        sqlexec.DB      // cfg.DB.Conn, classified once (what the wake-on-commit LISTEN can use)
	relayed     atomic.Int64
	batches     atomic.Int64
	failures    atomic.Int64
	failedPubs  atomic.Int64
	quarantined atomic.Int64
	pauses      *topicPauses
	episodes    *episode.Log
	alternate   atomic.Uint64 // BatchSize 1: retried and fresh rows take turns
	channel     string        // the table's NOTIFY channel
	wake        chan struct{} // one pending wake of the workers (see listen)
	listening   atomic.Bool
	tracer      trace.Tracer
	lastErrMu   sync.Mutex
	lastErr     error

	// The LISTEN connection's ping (see listenOnce): after listenPing
	// without a notification the relay pings the server, and replaces the
	// connection when the ping takes longer than listenPingTimeout.
	listenPing        time.Duration
	listenPingTimeout time.Duration

	// The lifecycle (Run, Close, Running).
	runMu     sync.Mutex
	runDone   chan struct{} // while Run runs: closed when it returns
	running   chan struct{} // closed once Run relays
	startOnce sync.Once
	closing   chan struct{} // closed by Close
	closeOnce sync.Once
}

// The LISTEN connection's ping defaults (Relay.listenPing).
const (
	defaultListenPing        = 30 * time.Second
	defaultListenPingTimeout = 10 * time.Second
)

// NewRelay validates cfg and returns a Relay. The outbox table must exist,
// migrated by sqlschema.Migrate.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	store, err := outboxdb.New(cfg.DB)
	if err != nil {
		return nil, fmt.Errorf("outbox: NewRelay: %w", err)
	}
	batchPub, _ := cfg.Publisher.(BatchPublisher)
	return &Relay{
		cfg:      cfg,
		conn:     sqlexec.Of(cfg.DB.Conn),
		store:    store,
		batchPub: batchPub,
		channel:  channelName(cfg.DB),
		pauses:   newTopicPauses(cfg.ErrorBackoff, cfg.MaxErrorBackoff),
		episodes: episode.New(cfg.Logger, 0, 0),
		wake:     make(chan struct{}, 1),
		tracer:   tracing.Tracer(cfg.TracerProvider),

		listenPing:        defaultListenPing,
		listenPingTimeout: defaultListenPingTimeout,
		running:           make(chan struct{}),
		closing:           make(chan struct{}),
	}, nil
}

// RelayStats are counters since the Relay was created.
type RelayStats struct {
	// Relayed is the number of messages published and deleted.
	Relayed int64
	// Batches is the number of committed batches that relayed a message or
	// recorded a failure (an empty poll is not a batch).
	Batches int64
	// Failures is the number of batches (Run's, and Flush calls) that
	// failed: a publish failed, a row was quarantined, or the database
	// failed. Errors caused by the context ending are not counted.
	Failures int64
	// FailedPublishes is the number of messages whose publish failed (each
	// failure of a row counts; the row is retried after its backoff).
	FailedPublishes int64
	// Quarantined is the number of rows this Relay quarantined: their
	// permanent failures reached MaxAttempts, or their metadata could not
	// be decoded. Each is also logged at Error level.
	Quarantined int64
	// LastError is the error of the latest failed batch, nil if none.
	LastError error
	// Listening is true while Run holds a LISTEN connection: committed
	// outbox rows wake the relay at once (see RelayConfig.ListenConnString).
	// False before Run, after it, when LISTEN is not possible with this
	// configuration, and while the connection is being re-established.
	// Always false on MySQL, which has no LISTEN (see WakeRelays).
	Listening bool
}

// Stats returns the Relay's counters.
func (r *Relay) Stats() RelayStats {
	r.lastErrMu.Lock()
	defer r.lastErrMu.Unlock()
	return RelayStats{
		Relayed:         r.relayed.Load(),
		Batches:         r.batches.Load(),
		Failures:        r.failures.Load(),
		FailedPublishes: r.failedPubs.Load(),
		Quarantined:     r.quarantined.Load(),
		LastError:       r.lastErr,
		Listening:       r.listening.Load(),
	}
}

// Run relays until ctx is done or Close is called, then returns nil after
// the batches in flight finished (each either committed or rolled back).
// Errors are logged, not returned. A full batch of which something was
// published is followed at once by the next. A topic whose rows that never
// failed before failed for reasons not their own, with none of its rows
// published (its destination, or the broker, looks down), is paused for
// ErrorBackoff, doubling to MaxErrorBackoff while it lasts, while the
// other topics flow; a batch the database failed is followed by a wait of
// the same length (MaxErrorBackoff when the database refuses writes:
// ErrDBReadOnly). Rows that failed wait out their own backoff (see
// RelayConfig.ErrorBackoff) while the rows behind them are relayed.
//
// Run may be called once at a time per Relay (a second call while one
// runs returns an error); after it returned because ctx ended it may be
// called again. Once Close was called, Run returns nil at once. Running
// tells when it relays.
func (r *Relay) Run(ctx context.Context) error {
	r.runMu.Lock()
	if r.runDone != nil {
		r.runMu.Unlock()
		return errors.New("outbox: Relay.Run is already running")
	}
	select {
	case <-r.closing:
		r.runMu.Unlock()
		return nil
	default:
	}
	done := make(chan struct{})
	r.runDone = done
	r.runMu.Unlock()
	defer func() {
		r.runMu.Lock()
		r.runDone = nil
		r.runMu.Unlock()
		close(done)
	}()

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	wg.Go(func() {
		select {
		case <-r.closing:
			cancel()
		case <-ctx.Done():
		}
	})
	wg.Go(func() { r.startupCheck(ctx) })
	switch {
	case r.cfg.NoListen:
	case r.cfg.DB.Dialect == sqlschema.MySQL:
		wg.Go(func() { r.wakeInProcess(ctx) })
	default:
		wg.Go(func() { r.listen(ctx) })
	}
	for range r.cfg.Workers {
		wg.Go(func() { r.work(ctx) })
	}
	r.startOnce.Do(func() { close(r.running) })
	wg.Wait()
	return nil
}

// Close stops a running Run and waits for it to return (the batches in
// flight finish, as when Run's context ends). It is idempotent, and safe
// to call before Run, which then returns at once: a closed Relay does not
// relay again. Flush still works after Close. It returns nil.
func (r *Relay) Close() error {
	r.closeOnce.Do(func() { close(r.closing) })
	r.runMu.Lock()
	done := r.runDone
	r.runMu.Unlock()
	if done != nil {
		<-done
	}
	return nil
}

// Running returns a channel that is closed once Run relays (its workers
// started), as message.Router.Running does. It stays closed after Run
// returns; it is never closed when Run is not called (or is called only
// after Close).
func (r *Relay) Running() chan struct{} {
	return r.running
}

// checkSequence logs an error when the outbox table's id sequence hands
// out ids from a per-session cache (CACHE above 1): a transaction that
// commits later may then draw a smaller id, and the relay, which keeps a
// key's order by id, would publish it first. It reads the sequence itself,
// so it holds for tables made by any migration tool; a missing table is
// left to the batches (sqlschema.ErrNotMigrated).
func (r *Relay) checkSequence(ctx context.Context) {
	if r.cfg.DB.Dialect == sqlschema.MySQL {
		r.checkIDOrder(ctx)
		return
	}
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cache, seq, err := r.store.IDSequence(qctx, r.cfg.DB.Conn)
	switch {
	case errors.Is(err, outboxdb.ErrNoTable), err != nil && ctx.Err() != nil:
		return
	case err != nil:
		r.cfg.Logger.Info("outbox relay: start-up check could not read the outbox id sequence's cache (check it is 1 if you use ordering keys): "+err.Error(), nil)
		return
	case cache == nil || seq == nil:
		r.cfg.Logger.Info("outbox relay: start-up check found no sequence behind the outbox table's id column (check that its ids increase across sessions, a sequence with CACHE 1, if you use ordering keys)",
			watermill.LogFields{"outbox_table": r.cfg.DB.Outbox()})
	case *cache > 1:
		r.cfg.Logger.Error("outbox relay: start-up check: the outbox id sequence "+*seq+" caches "+strconv.FormatInt(*cache, 10)+
			" values per session: ids do not follow the order of commits, and messages with an ordering key can be relayed out of order; run ALTER SEQUENCE "+*seq+" CACHE 1", nil, nil)
	}
}

// checkIDOrder is checkSequence on MySQL: AUTO_INCREMENT has no
// per-session cache, but the ids of a key follow the commits of its
// writers only on InnoDB tables and one primary handing out ids
// (internal/outboxdb's IDOrder says why); it logs an error otherwise.
func (r *Relay) checkIDOrder(ctx context.Context) {
	qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	ok, why, err := r.store.IDOrder(qctx, r.cfg.DB.Conn)
	switch {
	case errors.Is(err, outboxdb.ErrNoTable), err != nil && ctx.Err() != nil:
	case err != nil:
		r.cfg.Logger.Info("outbox relay: start-up check could not tell whether the outbox's ids follow the order of commits (check it if you use ordering keys): "+err.Error(), nil)
	case !ok:
		r.cfg.Logger.Error("outbox relay: start-up check: "+why+": messages with an ordering key can be relayed out of order", nil,
			watermill.LogFields{"outbox_table": r.cfg.DB.Outbox()})
	}
}

// migrationVerdict is what the start-up check logs for the outbox's
// recorded migrations: at INFO that none is recorded (not migrated yet, or
// created from sqlschema.SQL by another tool, which records nothing: the
// polls tell which) or that all are; at ERROR which are missing when only
// some are (a table migrated by an earlier version of the library).
func migrationVerdict(status []sqlschema.MigrationStatus) (level, msg string) {
	var missing []string
	total := 0
	for _, m := range status {
		if m.Target == "outbox" {
			total++
			if !m.Applied {
				missing = append(missing, m.Name)
			}
		}
	}
	switch {
	case len(missing) == total:
		return "INFO", "outbox relay: start-up check: no migration is recorded for the outbox table (created with sqlschema.SQL by another tool?): its migrations are not checked"
	case len(missing) > 0:
		return "ERROR", "outbox relay: start-up check: the outbox table is not migrated to this version of the library (missing " + strings.Join(missing, ", ") + "): run 'exactlyonce migrate up' or sqlschema.Migrate with the same schema and table names"
	default:
		return "INFO", "outbox relay: start-up check passed: the outbox table is migrated to this version of the library"
	}
}

// startupCheck checks once that the outbox table has every migration of
// this version of the library, when the migrations table records any
// (tables made from sqlschema.SQL by another tool record none), and that
// its id sequence keeps ids in commit order, whatever made the table; it
// logs what it found. While the database cannot be reached it asks again
// every MaxErrorBackoff.
func (r *Relay) startupCheck(ctx context.Context) {
	for {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		status, err := sqlschema.Status(cctx, r.cfg.DB)
		cancel()
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			level, msg := migrationVerdict(status)
			if level == "ERROR" {
				r.cfg.Logger.Error(msg, nil, watermill.LogFields{"schema": r.cfg.DB.Schema, "outbox_table": r.cfg.DB.OutboxTable})
			} else {
				r.cfg.Logger.Info(msg, nil)
			}
			r.checkSequence(ctx)
			return
		}
		if !pgerr.Unreachable(err) && !errors.Is(err, context.DeadlineExceeded) {
			r.cfg.Logger.Info("outbox relay: start-up check could not tell (check the migrations yourself): "+err.Error(), nil)
			r.checkSequence(ctx)
			return
		}
		t := time.NewTimer(r.cfg.MaxErrorBackoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

func (r *Relay) work(ctx context.Context) {
	backoff := r.cfg.ErrorBackoff
	var catchUpUntil time.Time
	for ctx.Err() == nil {
		res, err := r.relayBatch(ctx)
		var wait time.Duration
		wakeable := false
		switch {
		case err != nil && ctx.Err() != nil:
			return
		case errors.Is(err, ErrDBReadOnly):
			// Connected to a standby (or a read-only server): nothing
			// was locked or published. Not an outage that a fast retry
			// outlives: say what to do, and ask again slowly.
			r.episodes.Fail(episodeReadOnly, "outbox relay: the database is read-only (a standby, or a read-only server: "+
				"connect the relay to the primary, e.g. target_session_attrs=read-write in a multi-host URL); retrying every "+
				r.cfg.MaxErrorBackoff.String(), err, nil)
			wait = r.cfg.MaxErrorBackoff
		case errors.Is(err, sqlschema.ErrNotMigrated):
			// A configuration error, not an outage: say what to do, and
			// poll slowly until someone does it.
			r.episodes.Fail(episodeNotMigrated, "outbox relay: the outbox table is not migrated, retrying every "+r.cfg.MaxErrorBackoff.String()+" (run 'exactlyonce migrate up' or sqlschema.Migrate)", err, nil)
			wait = r.cfg.MaxErrorBackoff
		case err != nil && res.locked == 0:
			// The database failed (publish failures are paced per row
			// and per topic: see topicPauses). Logged as an episode: when
			// it starts, while it goes on, and when it ends.
			r.episodes.Fail(episodeBatch, "outbox relay: batches are failing (the database), retrying with a backoff up to "+r.cfg.MaxErrorBackoff.String(), err, watermill.LogFields{"backoff": backoff.String()})
			wait = backoff
			backoff = min(2*backoff, r.cfg.MaxErrorBackoff)
		default:
			r.episodes.End(episodeNotMigrated, episodeBatch, episodeReadOnly)
			if err != nil {
				r.cfg.Logger.Error("outbox relay: rows failed, each is retried after its own backoff", err, r.failureFields(res, nil))
			}
			backoff = r.cfg.ErrorBackoff
			if res.locked == r.cfg.BatchSize && res.blocked < res.locked {
				continue
			}
			wait, wakeable = r.cfg.PollInterval, true
			if r.listening.Load() {
				// Catch-up (see notify.go): rows of transactions
				// that skipped their NOTIFY commit shortly after the
				// notified ones.
				now := time.Now()
				if res.relayed > 0 {
					catchUpUntil = now.Add(catchUpWindow)
				}
				if now.Before(catchUpUntil) {
					wait = min(wait, catchUpPoll)
				}
			}
		}
		var wake <-chan struct{}
		if wakeable {
			wake = r.wake
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		case <-wake:
			t.Stop()
		}
	}
}

// The kinds of the relay's episodes (see internal/episode).
const (
	episodeNotMigrated = "not-migrated"
	episodeBatch       = "batch"
	episodeReadOnly    = "read-only"
)

// logSample is how many failed rows' UUIDs a failure's log line names.
const logSample = 5

// finishTimeout bounds the DELETE and UPDATE that follow a publish. It does
// not depend on the caller's context: once the broker has a batch, deleting
// its rows is worth finishing even while the relay shuts down.
const finishTimeout = 30 * time.Second

// Flush relays one batch of the rows pending now, in one transaction, and
// returns how many messages it published and deleted: it is Run's step,
// for tests and one-shot tools (call it until it returns 0 to drain the
// table); a service calls Run. It needs no Run, and may be called while
// Run runs or after Close.
//
// The batch is the oldest BatchSize rows that are neither quarantined nor
// waiting out the backoff of an earlier failure; rows that failed before
// take at most half of it when enough others wait. They are published in id order, the rows that failed
// before first, each of those in a Publish call of its own, the others with
// consecutive rows of one topic in one call. When a call of several
// messages fails, its messages are published one at a time, so that a
// message the broker can never take fails on its own and the rest still
// go. When two calls in a row fail, before anything of the batch was
// published, for reasons that are not the messages' own (the broker looks
// down), it stops early, leaving the rows not tried as they were.
//
// When RelayConfig.Publisher implements BatchPublisher, the whole batch
// (retried rows first, then the others, each in id order) is handed to
// PublishBatch in one call instead, and every message of it has an outcome.
//
// In the same transaction, the rows the publisher accepted are deleted, and
// each row that failed has its failure recorded: it is skipped until its
// backoff ends (see RelayConfig.ErrorBackoff), and quarantined when its
// permanent failures (RelayConfig.IsPermanent) reach RelayConfig.MaxAttempts.
// A row whose metadata cannot be decoded is quarantined at once. The error
// returned, if any, describes the failures; the count is still that of the
// rows relayed. A crash (or a failed commit) after a publish leaves rows
// that were sent: they are sent again later (at-least-once).
//
// Cancelling ctx stops Flush before the next poll or publish, but what
// the publisher already accepted is still deleted and committed. An error
// caused by ctx ending is not counted in Stats().Failures.
func (r *Relay) Flush(ctx context.Context) (n int, err error) {
	res, err := r.relayBatch(ctx)
	return res.relayed, err
}

// relayBatch relays one batch (see Flush); the error is counted and
// kept for Stats.
func (r *Relay) relayBatch(ctx context.Context) (batchResult, error) {
	res, err := r.relayBatchOnce(ctx)
	if err != nil && ctx.Err() == nil {
		r.failures.Add(1)
		r.lastErrMu.Lock()
		r.lastErr = err
		r.lastErrMu.Unlock()
	}
	return res, err
}

// batchResult is what one batch did.
type batchResult struct {
	locked      int      // rows locked, including unreadable and blocked ones
	blocked     int      // rows left as they were: an earlier row of their key is elsewhere
	relayed     int      // rows published and deleted
	failed      int      // rows whose publish failed, recorded
	permanent   int      // of those, failures that were the message's own
	paused      []string // topics paused after this batch (see topicPauses)
	defects     int      // rows quarantined at once (unreadable metadata)
	quarantined int      // rows quarantined, defects included
	sample      []string // UUIDs of the first failed rows, for the log
}

// failureFields are the log fields of a batch with failures: what was
// published, what failed (the first few UUIDs), what was quarantined.
func (r *Relay) failureFields(res batchResult, fields watermill.LogFields) watermill.LogFields {
	return fields.Add(watermill.LogFields{
		"relayed": res.relayed, "failed": res.failed, "permanent": res.permanent,
		"quarantined": res.quarantined, "failed_uuids": strings.Join(res.sample, ","),
		"paused_topics": strings.Join(res.paused, ","),
	})
}

func (r *Relay) relayBatchOnce(ctx context.Context) (res batchResult, err error) {
	// The transaction outlives ctx (database/sql would roll it back on
	// cancel, and pgx commits with the context it began with). It is READ
	// COMMITTED whatever the default: under REPEATABLE READ, SKIP LOCKED
	// meeting a row another relay deleted after the snapshot fails (40001).
	tx, err := r.cfg.DB.Conn.BeginTx(context.WithoutCancel(ctx), &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return res, r.own(fmt.Errorf("outbox relay: begin: %w", err))
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()

	b, err := r.lockBatch(ctx, tx)
	if err != nil {
		return res, r.own(err)
	}
	res.locked = len(b.ids) + len(b.defects) + b.blocked
	res.blocked = b.blocked
	if res.locked == 0 {
		if err := tx.Commit(); err != nil {
			return res, r.own(fmt.Errorf("outbox relay: commit: %w", err))
		}
		committed = true
		return res, nil
	}
	endSpans := r.startPublishSpans(b)
	p := r.publishInOrder(ctx, b)
	endSpans(p)
	if len(p.done) == 0 && len(p.failed) == 0 && len(b.defects) == 0 {
		return res, p.cancelled // cancelled before the first publish: nothing to record
	}

	finishCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
	defer cancel()
	if len(p.done) > 0 {
		if err := r.store.DeleteRelayed(finishCtx, tx, p.done); err != nil {
			return res, r.own(fmt.Errorf("outbox relay: deleting relayed rows: %w", err))
		}
	}
	var quarantined []quarantinedRow
	if len(p.failed) > 0 || len(b.defects) > 0 {
		quarantined, err = r.recordFailures(finishCtx, tx, b, p.failed)
		if err != nil {
			return res, r.own(err)
		}
	}
	if err := tx.Commit(); err != nil {
		return res, r.own(fmt.Errorf("outbox relay: commit: %w", err))
	}
	committed = true
	r.relayed.Add(int64(len(p.done)))
	r.batches.Add(1)
	r.failedPubs.Add(int64(len(p.failed)))
	r.quarantined.Add(int64(len(quarantined)))
	for _, q := range quarantined {
		r.cfg.Logger.Error("outbox relay: row quarantined; it is skipped until outbox.Store.RequeueFailed",
			errors.New(q.lastError), watermill.LogFields{
				"id": q.id, "topic": q.topic, "uuid": q.uuid, "permanent_failures": q.attempts, "failures": q.failures,
			})
	}
	res.relayed, res.failed, res.defects, res.quarantined = len(p.done), len(p.failed), len(b.defects), len(quarantined)
	published, freshFailed := map[string]bool{}, map[string]bool{}
	topicOf := make(map[int64]string, len(b.ids))
	for i, id := range b.ids {
		topicOf[id] = b.topics[i]
	}
	for _, id := range p.done {
		published[topicOf[id]] = true
	}
	for _, f := range p.failed {
		if !f.permanent && !f.retry {
			freshFailed[f.topic] = true
		}
	}
	res.paused = r.pauses.record(time.Now(), published, freshFailed)
	for _, f := range p.failed {
		if f.permanent {
			res.permanent++
		}
		if len(res.sample) < logSample {
			res.sample = append(res.sample, f.uuid)
		}
	}
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
		q := res.quarantined - res.defects
		note = append(note, fmt.Sprintf("%d failed and wait for a retry", res.failed-q))
		if q > 0 {
			note = append(note, fmt.Sprintf("%d quarantined after %d permanent failures", q, r.cfg.MaxAttempts))
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

// own marks an error of the relay's own SQL (not the publisher's, which may
// be SQL-backed too): a missing outbox table or column is reported as
// sqlschema.ErrNotMigrated, with the fix; a write the server refuses
// because it is read-only wraps ErrDBReadOnly.
func (r *Relay) own(err error) error { return pgerr.IfReadOnly(ifNotMigrated(r.cfg.DB, err)) }

// startPublishSpans starts an "exactlyonce.relay.publish" span per message
// of b, each a child of the span that wrote its row, and puts it in the
// message's context; the function returned ends them with their outcome
// (a message neither published nor failed was not tried: cancelled).
func (r *Relay) startPublishSpans(b batch) func(published) {
	spans := make(map[int64]trace.Span, len(b.ids))
	for i, msg := range b.msgs {
		parent := msg.Context()
		if sc := tracing.Extract(msg.Metadata); sc.IsValid() {
			parent = trace.ContextWithRemoteSpanContext(parent, sc)
		}
		ctx, span := r.tracer.Start(parent, "exactlyonce.relay.publish", trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(
				attribute.String("messaging.destination.name", b.topics[i]),
				attribute.String("messaging.message.id", msg.UUID),
				attribute.Int64("exactlyonce.outbox.id", b.ids[i]),
				attribute.Bool("exactlyonce.outbox.retry", b.retry[i])))
		msg.SetContext(ctx)
		spans[b.ids[i]] = span
	}
	return func(p published) {
		for _, id := range p.done {
			if s, ok := spans[id]; ok {
				s.End()
				delete(spans, id)
			}
		}
		for _, f := range p.failed {
			if s, ok := spans[f.id]; ok {
				s.RecordError(f.err)
				s.SetStatus(codes.Error, f.err.Error())
				s.End()
				delete(spans, f.id)
			}
		}
		for _, s := range spans {
			s.SetStatus(codes.Error, "not published in this batch: the relay stopped, or an earlier message of its ordering key was not accepted")
			s.End()
		}
	}
}
