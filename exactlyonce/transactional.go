package exactlyonce

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
)

// maxClaimTries bounds the claims of one delivery that lose a race under
// REPEATABLE READ or SERIALIZABLE (see beginClaim).
const maxClaimTries = 5

// handleTransactional claims the key, runs the handler and writes its
// output messages in one transaction, and commits.
func (m *Guard) handleTransactional(d *delivery, h message.HandlerFunc) {
	endClaim := m.startClaim(d)
	tx, claim, err := m.beginClaim(d.ctx, d.consumer, d.key)
	endClaim(err)
	if errors.Is(err, inboxdb.ErrNotDone) {
		err = claimError(d, ErrClaimFailed, err)
		m.claimFailed(err, watermill.LogFields{"message_uuid": d.msg.UUID, "consumer": d.consumer, "key": d.key})
		d.nackLater(reported(err)) // a configuration error: never succeeds on redelivery
		return
	}
	if err != nil {
		m.claimFailure(d, h, err)
		return
	}
	m.claimed()
	if !claim.Claimed {
		rec := claim.Existing
		d.ev.FirstSeenAt = rec.FirstSeenAt
		if rec.Status != inboxdb.StatusParked {
			m.cfg.Logger.Debug("exactlyonce: duplicate message acked without running the handler", watermill.LogFields{
				"message_uuid": d.msg.UUID, "consumer": d.consumer, "key": d.key,
				"first_seen_at": rec.FirstSeenAt, "duplicates": rec.Duplicates,
			})
		}
		d.settle(existing(rec), nil)
		return
	}
	done := false
	defer func() {
		if !done {
			_ = tx.Rollback()
		}
	}()

	ob := &lazyOutbox{tx: readyTx(tx), w: m.outbox, ctx: d.ctx, tracer: m.tracer}
	produced, err := m.runHandler(d, h, &handlerValues{tx: ob.tx, outbox: ob, consumer: d.consumer, key: d.key})
	if err != nil {
		_ = tx.Rollback()
		done = true
		if marked(err) {
			m.parkTransactional(d, err)
			return
		}
		m.handlerFailed(d, err)
		return
	}
	// Before the library's own writes: on MySQL a deadlock the handler
	// ignored ended the transaction, and they would commit on their own.
	if err := m.store.CheckOpen(context.WithoutCancel(d.ctx), tx, d.consumer, d.key); err != nil {
		_ = tx.Rollback()
		done = true
		d.nack(commitError(d, err))
		return
	}
	outputs, err := m.prepareOutputs(d, produced)
	if err == nil {
		err = outputs.write(ob)
	}
	if err != nil {
		_ = tx.Rollback()
		done = true
		if isOutputError(err) {
			// Refused before any SQL: the same on every redelivery.
			m.cfg.Logger.Error("exactlyonce: the handler's output messages cannot be written, message will be redelivered", err,
				watermill.LogFields{"message_uuid": d.msg.UUID, "consumer": d.consumer, "key": d.key})
			d.nackLater(err)
			return
		}
		d.nack(err)
		return
	}
	ob.beforeCommit(context.WithoutCancel(d.ctx))
	done = true
	if err := tx.Commit(); err != nil {
		if pgerr.ReadOnly(err) {
			d.nackLater(m.readOnlyFailed(d, commitError(d, err)))
			return
		}
		d.nack(commitError(d, err))
		return
	}
	ob.afterCommit()
	d.settle(Processed, nil)
}

// existing is the outcome of a delivery whose key its claim found
// recorded: Parked, or Duplicate (done).
func existing(rec inboxdb.Record) Outcome {
	if rec.Status == inboxdb.StatusParked {
		return Parked
	}
	return Duplicate
}

// claimError is the error of a delivery whose claim failed before its
// handler ran: sentinel is ErrClaimFailed or ErrDBUnavailable.
func claimError(d *delivery, sentinel, cause error) error {
	return fmt.Errorf("exactlyonce: claim of %q for %q: %w: %w", d.key, d.consumer, sentinel, cause)
}

// commitError is the error of a delivery whose transaction did not
// commit: the server refused the COMMIT (nothing committed; wrapping
// ErrDBReadOnly when it refuses writes), or its outcome is unknown.
func commitError(d *delivery, err error) error {
	if pgerr.CommitRefused(err) {
		return fmt.Errorf("exactlyonce: commit of %q for %q refused by the server, nothing committed (%s): %w",
			d.key, d.consumer, refusalCause(err), pgerr.IfReadOnly(err))
	}
	return fmt.Errorf("exactlyonce: commit of %q for %q failed, its outcome is unknown: %w", d.key, d.consumer, err)
}

// parkTransactional records the key parked after the handler returned a
// Permanent error (its transaction is rolled back), keeping the message
// with it in the same statement, and acks. If the record cannot be
// written, the delivery is nacked: nothing is lost.
func (m *Guard) parkTransactional(d *delivery, herr error) {
	ctx := context.WithoutCancel(d.ctx)
	if err := m.store.Park(ctx, m.cfg.DB.Conn, d.consumer, d.key, herr.Error(), m.parkedMessage(d)); err != nil {
		d.nack(fmt.Errorf("exactlyonce: %q for %q: the permanent failure could not be recorded: %w (handler: %w)",
			d.key, d.consumer, pgerr.IfNotMigrated(m.names, err), herr))
		return
	}
	m.parkedNow(d, herr, 0)
}

// beginClaim begins the message's transaction and claims the key in it.
// For a duplicate it returns a nil tx (the duplicate counter is already
// committed, best-effort). A pgx pool takes the one-round-trip path.
//
// The transaction has the database's default isolation (the handler's
// writes share it). Under REPEATABLE READ or SERIALIZABLE a claim that
// waited for another transaction's claim of the same key fails with a
// serialization failure when that one commits, because the row is not in
// this transaction's snapshot. The claim is the transaction's first
// statement, so nothing is lost by rolling back and claiming again in a new
// transaction, whose snapshot sees the winner's row: the delivery is then a
// duplicate, exactly as under READ COMMITTED.
//
// On the partitioned layout, a claim that found no partition for its record
// (inboxdb.ErrPartitionsChanged: the partitions changed since the store
// last looked) is retried the same way; the next one asks the database
// where the record goes.
func (m *Guard) beginClaim(ctx context.Context, consumer, key string) (wsql.Tx, inboxdb.ClaimResult, error) {
	for try := 1; ; try++ {
		tx, claim, err := m.beginClaimOnce(ctx, consumer, key)
		if err == nil || try == maxClaimTries || !claimAgain(err) || ctx.Err() != nil {
			return tx, claim, err
		}
	}
}

// claimAgain reports whether a claim that failed with err, as the first
// statements of its transaction, succeeds in a new transaction: it lost a
// race under REPEATABLE READ or SERIALIZABLE, or met a partition change.
func claimAgain(err error) bool {
	return pgerr.SerializationFailure(err) || errors.Is(err, inboxdb.ErrPartitionsChanged)
}

func (m *Guard) beginClaimOnce(ctx context.Context, consumer, key string) (wsql.Tx, inboxdb.ClaimResult, error) {
	if pool, ok := m.conn.PgxPool(); ok {
		tx, claim, err := m.store.BeginClaimPool(ctx, pool, consumer, key)
		if tx == nil {
			return nil, claim, err
		}
		return tx, claim, err
	}
	tx, err := m.cfg.DB.Conn.BeginTx(ctx, nil)
	if err != nil {
		return nil, inboxdb.ClaimResult{}, fmt.Errorf("begin: %w", err)
	}
	claim, err := m.store.ClaimTx(ctx, tx, consumer, key)
	if err != nil || !claim.Claimed {
		if err == nil {
			// The key is recorded as done whether or not the counter
			// update commits, so the delivery is acked either way.
			if cerr := tx.Commit(); cerr != nil {
				m.cfg.Logger.Info("exactlyonce: duplicate counter not committed", watermill.LogFields{"err": cerr.Error(), "key": key})
			}
			return nil, claim, nil
		}
		_ = tx.Rollback()
		return nil, claim, err
	}
	return tx, claim, nil
}

// literalClaimLogger logs, once per middleware, that its claims no longer
// use the prepared statement (inboxdb.Config.OnLiteralClaim).
func literalClaimLogger(logger watermill.LoggerAdapter) func(error) {
	return func(cause error) {
		logger.Info("exactlyonce: the claim's prepared statement was not in the database session its connection prepared it in "+
			"(a connection pooler in transaction pooling?): claims send the INSERT as literals from now on; "+
			"behind PgBouncer set default_query_exec_mode=exec on the pool (docs/pgbouncer.md), or Config.LiteralClaim",
			watermill.LogFields{"err": cause.Error()})
	}
}

// refusalCause says why the server refused a COMMIT (pgerr.CommitRefused),
// for the error the delivery is nacked with.
func refusalCause(err error) string {
	if errors.Is(err, pgx.ErrTxCommitRollback) {
		return "the server answered ROLLBACK: a statement of the transaction had failed and its error was ignored, by the handler most likely"
	}
	if errors.Is(err, pgerr.ErrRolledBack) {
		return "MySQL had rolled the transaction back after a deadlock or lock wait timeout whose error was ignored, by the handler most likely"
	}
	if n, ok := pgerr.MySQLNumber(err); ok {
		return fmt.Sprintf("MySQL error %d", n)
	}
	return "SQLSTATE " + pgerr.Code(err)
}

// handlerFailed settles a delivery whose handler returned err (not
// Permanent), as what err is (failedFate, group commit's too):
//
//   - one of the middleware's own refusals of the handler's output (an
//     outbox publish to no topic, a message the outbox cannot store), which
//     every redelivery meets again: logged as the configuration or data
//     error it is, and returned after NackDelay, so that the message is
//     kept without a tight redelivery loop;
//   - ErrNestedMiddleware (a second exactly-once middleware inside this
//     one refused the delivery, and logged it): returned after NackDelay,
//     for the same reason;
//   - a write the server refused because it is read-only (a standby):
//     wrapped with ErrDBReadOnly, logged as the read-only episode, and
//     returned after NackDelay;
//   - a conflict with another transaction on the handler's own rows
//     (pgerr.SerializationFailure: a deadlock, 40P01, or a serialization
//     failure, 40001): nothing of the message committed, and its
//     redelivery runs it again in a new transaction. Not an error of the
//     message: logged at info level (see conflictMessage), and marked for
//     RouterLogger;
//   - anything else: returned at once.
func (m *Guard) handlerFailed(d *delivery, err error) {
	f := failedFate(err)
	switch {
	case f.conflict:
		m.cfg.Logger.Info(conflictMessage+"; rolled back, the message will be redelivered", watermill.LogFields{
			"message_uuid": d.msg.UUID, "consumer": d.consumer, "key": d.key, "sqlstate": pgerr.Code(err), "err": err.Error()})
		f.err = reported(err)
	case errors.Is(f.err, ErrDBReadOnly):
		f.err = m.readOnlyFailed(d, f.err)
	case isOutputError(err):
		m.cfg.Logger.Error("exactlyonce: the handler's outbox publish was refused, message will be redelivered", err,
			watermill.LogFields{"message_uuid": d.msg.UUID, "consumer": d.consumer, "key": d.key})
	}
	settle(d, f)
}

// readOnlyFailed logs, as the middleware's read-only episode (see
// claimFailed), a write of the handler's transaction or its COMMIT that
// the server refused because it is read-only, and returns err (which wraps
// ErrDBReadOnly) marked for RouterLogger: nothing committed, and the
// message is nacked after NackDelay.
func (m *Guard) readOnlyFailed(d *delivery, err error) error {
	m.claimFailed(err, watermill.LogFields{"message_uuid": d.msg.UUID, "consumer": d.consumer, "key": d.key})
	return reported(err)
}

// conflictMessage is the log line of a handler whose statement met a
// conflict with another transaction on the handler's own rows.
const conflictMessage = "exactlyonce: a statement of the handler conflicted with another transaction on the handler's own rows " +
	"(a deadlock or serialization failure, not an error of the message; update rows in one order, by key, to make it rare)"
