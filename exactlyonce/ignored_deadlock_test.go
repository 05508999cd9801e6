package exactlyonce_test

// A handler that ignores its statement's deadlock error (MySQL/MariaDB).
// InnoDB rolls the victim's whole transaction back on a deadlock (1213) but
// keeps the session: the handler's later statements run on their own
// (autocommit), and a COMMIT succeeds with nothing of the transaction in
// it, the inbox record (the claim) included. A middleware that committed
// and acked would lose the message's exactly-once record: its redelivery
// would run the handler again. The middleware checks, right before the
// COMMIT, that the transaction is still open (Store.CheckOpen), and nacks.
// PostgreSQL needs no such check: a failed statement aborts the
// transaction, and the COMMIT answers ROLLBACK (errors_test.go).

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// deadlockRig makes a handler's statement lose a deadlock, deterministically:
// the handler's transaction locks row A (lose), another transaction, which
// holds row B and has inserted many rows, waits for A, and the handler then
// asks for B. InnoDB rolls back the transaction with fewer changed rows:
// the handler's.
type deadlockRig struct {
	b                *testenv.Bundle
	locks, bulk      string
	holdsA, proceed  chan struct{}
	other            interface{ Commit() error }
	otherDone        chan error
	otherExec        func(query string) error
	handlerErr       error // the error the handler's statement got (and ignored)
	handlerErrNumber uint16
}

// bulkRows is how many rows the other transaction inserts before it takes
// row B: far more than the handler's transaction changes.
const bulkRows = 1000

func newDeadlockRig(t *testing.T, b *testenv.Bundle) *deadlockRig {
	t.Helper()
	r := &deadlockRig{b: b, locks: b.Table("locks"), bulk: b.Table("bulk"),
		holdsA: make(chan struct{}), proceed: make(chan struct{}), otherDone: make(chan error, 1)}
	b.Exec(t, "CREATE TABLE "+r.locks+" (id VARCHAR(8) PRIMARY KEY, n INT NOT NULL)")
	b.Exec(t, "INSERT INTO "+r.locks+" VALUES ('A', 0), ('B', 0)")
	b.Exec(t, "CREATE TABLE "+r.bulk+" (id INT AUTO_INCREMENT PRIMARY KEY)")
	other := b.Begin(t) // another worker's transaction, on another connection
	_, err := other.ExecContext(b.Ctx, "INSERT INTO "+r.bulk+" () VALUES ()"+strings.Repeat(", ()", bulkRows-1))
	require.NoError(t, err)
	_, err = other.ExecContext(b.Ctx, "UPDATE "+r.locks+" SET n = n + 1 WHERE id = 'B'")
	require.NoError(t, err)
	r.other = other
	r.otherExec = func(q string) error { _, err := other.ExecContext(b.Ctx, q); return err }
	return r
}

// lose runs in the handler: it locks A, lets the other transaction wait
// for A, asks for B, and returns that statement's error (the deadlock).
func (r *deadlockRig) lose(ctx context.Context) error {
	if err := testenv.Exec(ctx, "UPDATE "+r.locks+" SET n = n + 1 WHERE id = 'A'"); err != nil {
		return err
	}
	close(r.holdsA)
	<-r.proceed
	err := testenv.Exec(ctx, "UPDATE "+r.locks+" SET n = n + 1 WHERE id = 'B'")
	r.handlerErr = err
	r.handlerErrNumber, _ = pgerr.MySQLNumber(err)
	return err
}

// play waits until the handler holds A, makes the other transaction wait
// for A, and lets the handler ask for B.
func (r *deadlockRig) play(t *testing.T) {
	t.Helper()
	select {
	case <-r.holdsA:
	case <-time.After(30 * time.Second):
		t.Fatal("the handler never locked row A")
	}
	go func() { r.otherDone <- r.otherExec("UPDATE " + r.locks + " SET n = n + 1 WHERE id = 'A'") }()
	r.b.WaitForLockWaiter(t)
	close(r.proceed)
}

// finish asserts that the handler's statement lost the deadlock, and that
// the other transaction got A and commits.
func (r *deadlockRig) finish(t *testing.T) {
	t.Helper()
	require.Error(t, r.handlerErr, "the handler's statement lost the deadlock")
	require.Equal(t, uint16(1213), r.handlerErrNumber, "a deadlock: %v", r.handlerErr)
	select {
	case err := <-r.otherDone:
		require.NoError(t, err, "the other transaction won")
	case <-time.After(30 * time.Second):
		t.Fatal("the other transaction never got row A")
	}
	require.NoError(t, r.other.Commit())
}

// TestIgnoredDeadlockNotAcked: one transaction per message. Neither the
// record nor the handler's output message commits (the output would, on
// its own, if the middleware wrote it after the rollback).
func TestIgnoredDeadlockNotAcked(t *testing.T) {
	t.Parallel()
	b := testenv.NewBundle(t, testenv.DriverNamed(t, testenv.MariaDB))
	effects := b.Table("effects")
	b.Exec(t, "CREATE TABLE "+effects+" (id VARCHAR(64) NOT NULL)")
	r := newDeadlockRig(t, b)
	var ev testenv.Counters
	eo, err := exactlyonce.New(exactlyonce.Config{DB: b.DB, Consumer: "c", PublishTopic: "out", NackDelay: -1, OnEvent: ev.Observe, Logger: testenv.Logger(t)})
	require.NoError(t, err)
	var runs atomic.Int64
	h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		if runs.Add(1) == 1 {
			_ = r.lose(msg.Context()) // the deadlock's error, ignored
		}
		if err := testenv.Exec(msg.Context(), "INSERT INTO "+effects+" (id) VALUES (?)", msg.UUID); err != nil {
			return nil, err
		}
		return []*message.Message{message.NewMessage("out-"+msg.UUID, nil)}, nil
	})
	outbox := "SELECT count(*) FROM " + b.DB.Outbox()

	done := make(chan error, 1)
	go func() { _, err := h(message.NewMessage("k", nil)); done <- err }()
	r.play(t)
	var herr error
	select {
	case herr = <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("the delivery did not return")
	}
	r.finish(t)
	require.Error(t, herr, "a delivery whose transaction the server rolled back must not be acked")
	require.ErrorIs(t, herr, pgerr.ErrRolledBack)
	require.Zero(t, ev.Processed.Load())
	require.Zero(t, b.Count(t, "SELECT count(*) FROM "+b.DB.Inbox()), "the claim was rolled back with the transaction")
	require.Zero(t, b.Count(t, outbox), "the output message is not written on its own (autocommit) either")

	// Its redelivery runs the handler again, and is processed once.
	_, err = h(message.NewMessage("k", nil))
	require.NoError(t, err)
	_, err = h(message.NewMessage("k", nil))
	require.NoError(t, err)
	require.Equal(t, int64(2), runs.Load())
	require.Equal(t, int64(1), ev.Processed.Load())
	require.Equal(t, int64(1), ev.Duplicates.Load())
	require.Equal(t, int64(1), b.Count(t, "SELECT count(*) FROM "+b.DB.Inbox()+" WHERE status = 'done'"))
	require.Equal(t, int64(1), b.Count(t, outbox), "the processed attempt's output, once")
	// The handler's INSERT after the ignored deadlock ran on its own
	// (autocommit): the handler's fault, which the middleware cannot undo;
	// the redelivery's INSERT committed with its record.
	require.Equal(t, int64(2), b.Count(t, "SELECT count(*) FROM "+effects+" WHERE id = 'k'"))
}

// TestIgnoredDeadlockNotAckedBatch: group commit. The batch's transaction
// is rolled back with the handler's: none of its deliveries is acked as
// processed without its record, and no output message is written on its
// own; the batch runs again split, and every key ends processed once, with
// its record and its one output.
func TestIgnoredDeadlockNotAckedBatch(t *testing.T) {
	t.Parallel()
	b := testenv.NewBundle(t, testenv.DriverNamed(t, testenv.MariaDB))
	r := newDeadlockRig(t, b)
	var ev eventLog
	eo := newBatchEO(t, b.DB, exactlyonce.BatchConfig{MaxSize: 3, MaxWait: forever}, &ev)
	var victimRuns atomic.Int64
	var others atomic.Int64
	h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
		out := []*message.Message{message.NewMessage("out-"+msg.UUID, nil)}
		if msg.UUID != "victim" {
			others.Add(1)
			return out, nil
		}
		if victimRuns.Add(1) == 1 {
			_ = r.lose(msg.Context()) // the deadlock's error, ignored
		}
		return out, nil
	})

	keys := []string{"a", "victim", "z"}
	done := make(chan []delivery, 1)
	go func() { done <- deliver(t, h, msgs(keys...)...) }()
	r.play(t)
	var ds []delivery
	select {
	case ds = <-done:
	case <-time.After(time.Minute):
		t.Fatal("the deliveries did not return")
	}
	r.finish(t)
	requireOneBatch(t, ds)
	for i, k := range keys {
		outcomes := ev.outcomes(k)
		require.NotEmpty(t, outcomes, k)
		if ds[i].err == nil {
			require.Equal(t, []exactlyonce.Outcome{exactlyonce.Processed}, outcomes, k)
			require.Equal(t, int64(1), inboxCount(t, b, "done", k), "%s: acked as processed, so recorded", k)
		} else {
			require.True(t, errors.Is(ds[i].err, pgerr.ErrRolledBack), "%s: %v", k, ds[i].err)
			require.Zero(t, inboxCount(t, b, "done", k), "%s: nacked, not recorded", k)
		}
	}
	require.Equal(t, int64(2), victimRuns.Load(), "the rolled-back batch ran again (split)")
	require.Equal(t, int64(3), b.Count(t, "SELECT count(*) FROM "+b.DB.Inbox()+" WHERE status = 'done'"))
	require.Equal(t, 3, ev.count(exactlyonce.Processed))
	require.Equal(t, int64(3), b.Count(t, "SELECT count(*) FROM "+b.DB.Outbox()),
		"one output per key: none written on its own (autocommit) after the rollback")
}
