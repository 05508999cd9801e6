package outbox

import (
	"context"
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
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
	// batch. A full batch is followed at once by the next. Defaults to 100ms.
	PollInterval time.Duration

	// ErrorBackoff is the first wait after a failed batch; it doubles with
	// each consecutive failure up to MaxErrorBackoff. Defaults to 500ms.
	ErrorBackoff time.Duration

	// MaxErrorBackoff caps ErrorBackoff. Defaults to 15s.
	MaxErrorBackoff time.Duration

	// MaxAttempts quarantines a row after it failed this many times on its
	// own while other rows of its batches were published (a message the
	// broker can never take: too large, a header it refuses). A quarantined
	// row is skipped instead of blocking the rows behind it; PendingStats
	// reports it and RequeueFailed puts it back. Failures of a whole batch
	// (a broker outage) count against no row. Defaults to 5.
	MaxAttempts int

	// Logger logs failed batches. Defaults to no logging.
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
	cfg        RelayConfig
	selectSQL  string
	deleteSQL  string
	failSQL    string
	relayed    atomic.Int64
	batches    atomic.Int64
	failures   atomic.Int64
	lastErrMu  sync.Mutex
	lastErr    error
	runningMux sync.Mutex
}

// NewRelay validates cfg and returns a Relay. The outbox table must exist.
func NewRelay(cfg RelayConfig) (*Relay, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	table := cfg.Tables.Outbox()
	return &Relay{
		cfg: cfg,
		selectSQL: `SELECT id, topic, uuid, payload, metadata::text FROM ` + table +
			` WHERE attempts < ` + strconv.Itoa(cfg.MaxAttempts) + ` ORDER BY id LIMIT $1 FOR UPDATE SKIP LOCKED`,
		deleteSQL: `DELETE FROM ` + table + ` WHERE id = ANY($1)`,
		failSQL:   `UPDATE ` + table + ` SET attempts = attempts + 1, last_error = $2 WHERE id = $1`,
	}, nil
}

// RelayStats are counters since the Relay was created.
type RelayStats struct {
	// Relayed is the number of messages published and deleted.
	Relayed int64
	// Batches is the number of committed batches.
	Batches int64
	// Failures is the number of batches that failed and were rolled back.
	Failures int64
	// LastError is the error of the latest failed batch, nil if none.
	LastError error
}

// Stats returns the Relay's counters.
func (r *Relay) Stats() RelayStats {
	r.lastErrMu.Lock()
	defer r.lastErrMu.Unlock()
	return RelayStats{
		Relayed:   r.relayed.Load(),
		Batches:   r.batches.Load(),
		Failures:  r.failures.Load(),
		LastError: r.lastErr,
	}
}

// Run relays until ctx is done, then returns nil after the batches in
// flight finished (each either committed or rolled back). Failed batches
// are rolled back, logged and retried after a backoff; Run does not return
// on them. Run may be called once at a time per Relay.
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
		n, err := r.RelayOnce(ctx)
		var wait time.Duration
		switch {
		case err != nil && ctx.Err() != nil:
			return
		case err != nil:
			r.cfg.Logger.Error("outbox relay: batch failed, will retry", err, watermill.LogFields{"backoff": backoff.String()})
			wait = backoff
			backoff = min(2*backoff, r.cfg.MaxErrorBackoff)
		case n < r.cfg.BatchSize:
			backoff = r.cfg.ErrorBackoff
			wait = r.cfg.PollInterval
		default:
			backoff = r.cfg.ErrorBackoff
			continue
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

// finishTimeout bounds the DELETE that follows a publish. It does not
// depend on the caller's context: once the broker has a batch, deleting its
// rows is worth finishing even while the relay shuts down.
const finishTimeout = 30 * time.Second

// RelayOnce relays at most one batch in one transaction and returns how many
// messages it published and deleted. If a Publish call fails, the rows of the
// calls that succeeded before it are still deleted and committed, and the
// error is returned; the other rows stay for a later attempt. A crash (or a
// failed commit) after a publish leaves rows that were sent: they are sent
// again later (at-least-once).
//
// Cancelling ctx stops RelayOnce before the next poll or publish, but a
// batch the publisher already accepted is still deleted and committed. An
// error caused by ctx ending is not counted in Stats().Failures.
func (r *Relay) RelayOnce(ctx context.Context) (n int, err error) {
	defer func() {
		if err != nil && ctx.Err() == nil {
			r.failures.Add(1)
			r.lastErrMu.Lock()
			r.lastErr = err
			r.lastErrMu.Unlock()
		}
	}()
	// The transaction outlives ctx (database/sql would roll it back on
	// cancel, and pgx commits with the context it began with).
	// The transaction is READ COMMITTED whatever the database's default:
	// under REPEATABLE READ, SKIP LOCKED meeting a row that another relay
	// deleted after this transaction's snapshot fails with 40001.
	tx, err := r.cfg.DB.BeginTx(context.WithoutCancel(ctx), &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return 0, fmt.Errorf("outbox relay: begin: %w", err)
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()

	batch, err := r.lockBatch(ctx, tx)
	if err != nil {
		return 0, err
	}
	if len(batch.ids) == 0 {
		if err := tx.Commit(); err != nil {
			return 0, fmt.Errorf("outbox relay: commit: %w", err)
		}
		committed = true
		return 0, nil
	}
	done, failed, pubErr := r.publish(ctx, batch)
	if len(done) == 0 {
		return 0, pubErr
	}
	finishCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
	defer cancel()
	if _, err := tx.ExecContext(finishCtx, r.deleteSQL, done); err != nil {
		return 0, fmt.Errorf("outbox relay: deleting relayed rows: %w", err)
	}
	for id, ferr := range failed {
		if _, err := tx.ExecContext(finishCtx, r.failSQL, id, pgtext.Storable(ferr.Error(), maxErrorText)); err != nil {
			return 0, fmt.Errorf("outbox relay: recording a failed row: %w", err)
		}
	}
	if err := tx.Commit(); err != nil {
		return 0, fmt.Errorf("outbox relay: commit: %w", err)
	}
	committed = true
	r.relayed.Add(int64(len(done)))
	r.batches.Add(1)
	return len(done), pubErr
}

// publish hands the batch to the publisher, consecutive rows of one topic in
// one Publish call, in id order. When a call fails, its messages are
// published one at a time: a message the broker can never take (too large, a
// header it refuses) then fails on its own while the others go through. Such
// failures are returned in failed (by row id), to be counted against the row;
// when nothing of the batch gets through, it looks like an outage and no row
// is blamed. done lists the ids the publisher accepted.
func (r *Relay) publish(ctx context.Context, b batch) (done []int64, failed map[int64]error, err error) {
	failed = map[int64]error{}
	anyOK := false
	deadGroups := 0
	var firstErr error
	for start := 0; start < len(b.msgs); {
		if cerr := ctx.Err(); cerr != nil {
			return done, nil, cerr
		}
		end := start + 1
		for end < len(b.msgs) && b.topics[end] == b.topics[start] {
			end++
		}
		topic := b.topics[start]
		gerr := r.cfg.Publisher.Publish(topic, b.msgs[start:end]...)
		if gerr == nil {
			done = append(done, b.ids[start:end]...)
			anyOK = true
			start = end
			continue
		}
		if firstErr == nil {
			firstErr = fmt.Errorf("outbox relay: publishing %d message(s) to %q: %w", end-start, topic, gerr)
		}
		groupOK := false
		if end-start > 1 {
			for j := start; j < end; j++ {
				if e := r.cfg.Publisher.Publish(topic, b.msgs[j]); e != nil {
					failed[b.ids[j]] = e
				} else {
					done = append(done, b.ids[j])
					groupOK = true
				}
			}
		} else {
			failed[b.ids[start]] = gerr
		}
		if !groupOK {
			deadGroups++
			if !anyOK && deadGroups >= 2 {
				break // nothing gets through: an outage, most likely
			}
		}
		anyOK = anyOK || groupOK
		start = end
	}
	if !anyOK {
		return nil, nil, firstErr
	}
	if len(failed) > 0 {
		return done, failed, fmt.Errorf("outbox relay: %d message(s) failed on their own while others were published (each counts an attempt; quarantined at %d): %w",
			len(failed), r.cfg.MaxAttempts, firstErr)
	}
	return done, nil, nil
}

// maxErrorText bounds the last_error stored on a failing row.
const maxErrorText = 2000

type batch struct {
	ids    []int64
	topics []string
	msgs   []*message.Message
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
		)
		if err := rows.Scan(&id, &topic, &uuid, &payload, &meta); err != nil {
			_ = rows.Close()
			return batch{}, fmt.Errorf("outbox relay: reading batch: %w", err)
		}
		msg := message.NewMessage(uuid, payload)
		if err := json.Unmarshal([]byte(meta), &msg.Metadata); err != nil {
			_ = rows.Close()
			return batch{}, fmt.Errorf("outbox relay: row %d has unreadable metadata: %w", id, err)
		}
		if msg.Metadata == nil {
			msg.Metadata = message.Metadata{}
		}
		msg.SetContext(ctx)
		b.ids = append(b.ids, id)
		b.topics = append(b.topics, topic)
		b.msgs = append(b.msgs, msg)
	}
	if err := seam.Close(rows); err != nil {
		return batch{}, fmt.Errorf("outbox relay: reading batch: %w", err)
	}
	return b, nil
}

// Pending describes the outbox backlog.
type Pending struct {
	// Count is the number of rows not relayed yet.
	Count int64
	// OldestCreatedAt is the creation time of the oldest pending row; nil
	// when there is none.
	OldestCreatedAt *time.Time
	// OldestAge is now() - OldestCreatedAt as the database sees it; zero
	// when there is no pending row. Alert on it.
	OldestAge time.Duration
	// Failing counts rows that failed on their own at least once (see
	// RelayConfig.MaxAttempts); some may be quarantined. Alert on it, read
	// their last_error, fix the cause, then RequeueFailed.
	Failing int64
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
		`SELECT count(*), min(created_at), extract(epoch FROM now() - min(created_at))::float8, count(*) FILTER (WHERE attempts > 0) FROM `+tables.Outbox(),
		nil, &p.Count, &p.OldestCreatedAt, &ageSeconds, &p.Failing)
	if err != nil {
		return Pending{}, fmt.Errorf("outbox: pending stats: %w", err)
	}
	if ageSeconds != nil {
		p.OldestAge = time.Duration(*ageSeconds * float64(time.Second))
	}
	return p, nil
}

// RequeueFailed clears the failure count of every outbox row in tables, so
// that quarantined rows are relayed again. Use it after fixing the cause.
func RequeueFailed(ctx context.Context, db wsql.ContextExecutor, tables sqlschema.Config) (int64, error) {
	if err := tables.Validate(); err != nil {
		return 0, err
	}
	n, err := seam.Exec(ctx, db, `UPDATE `+tables.Outbox()+` SET attempts = 0, last_error = NULL WHERE attempts > 0`)
	if err != nil {
		return 0, fmt.Errorf("outbox: requeue failed rows: %w", err)
	}
	return n, nil
}
