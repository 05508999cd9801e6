package inboxdb_test

// ClaimBatchTx, the claim of group commit: many keys of one consumer in one
// multi-row statement inside the caller's transaction, with the semantics of
// ClaimTx per key, results in the order given, and row locks taken in key
// order so that two batches sharing keys cannot deadlock.

import (
	"context"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

type batchOutcome struct {
	res  []inboxdb.ClaimResult
	errs []error
	err  error
}

// claimBatch claims keys in a transaction of its own and commits it.
func (b bundle) claimBatch(t *testing.T, consumer string, keys ...string) ([]inboxdb.ClaimResult, []error) {
	t.Helper()
	tx := b.begin(t)
	res, errs, err := b.store.ClaimBatchTx(b.ctx, tx, consumer, keys)
	require.NoError(t, err)
	require.NoError(t, tx.Commit())
	return res, errs
}

func (b bundle) backendPID(t *testing.T, tx wsql.Tx) int {
	t.Helper()
	var pid int
	require.NoError(t, seam.QueryRow(b.ctx, tx, b.sql("SELECT pg_backend_pid()", "SELECT CONNECTION_ID()"), nil, &pid))
	return pid
}

// awaitBlocked waits until a session is blocked by the backend pid
// (PostgreSQL).
func (b bundle) awaitBlocked(t *testing.T, pid int, what string) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, func() bool {
		var n int
		err := seam.QueryRow(b.ctx, b.db, "SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))", []any{pid}, &n)
		return err == nil && n >= 1
	}, what)
}

// awaitWaiting waits until the session of pid (backendPID: on MySQL, the
// connection id) waits for a lock. On MySQL it waits until the session's
// statement has been running for 100 ms: the InnoDB lock tables of
// information_schema are a cache refreshed only when it was not read for
// 100 ms, which tests polling in parallel prevent (and performance_schema
// may be off); the statements waited for are one-row writes.
func (b bundle) awaitWaiting(t *testing.T, pid int, what string) {
	t.Helper()
	testenv.Eventually(t, 10*time.Second, func() bool {
		var n int
		err := seam.QueryRow(b.ctx, b.db, b.sql("SELECT cardinality(pg_blocking_pids($1))",
			"SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = ? AND COMMAND IN ('Query', 'Execute') AND TIME_MS >= 100"), []any{pid}, &n)
		return err == nil && n >= 1
	}, what)
}

// insertProcessing inserts a lease-mode record of (consumer, key) in the
// middle of an attempt.
func (b bundle) insertProcessing(t *testing.T, consumer, key string) {
	t.Helper()
	b.exec(t, "INSERT INTO "+b.store.Table()+b.sql(` (consumer, message_key, status, attempts, lease_until, lease_token)
VALUES ($1, $2, 'processing', 1, now() + interval '1 hour', gen_random_uuid())`,
		` (consumer, message_key, status, attempts, lease_until, lease_token, first_seen_at)
VALUES (?, ?, 'processing', 1, UTC_TIMESTAMP(6) + INTERVAL 1 HOUR, UUID(), UTC_TIMESTAMP(6))`), consumer, key)
}

func TestClaimBatchTxAllNew(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		res, errs, err := b.store.ClaimBatchTx(b.ctx, b.db, "c", nil)
		require.NoError(t, err)
		require.Empty(t, res)
		require.Empty(t, errs)

		keys := []string{"m-3", "m-1", "m-20", "m-2"}
		tx := b.begin(t)
		res, errs, err = b.store.ClaimBatchTx(b.ctx, tx, "c", keys)
		require.NoError(t, err)
		require.Len(t, res, len(keys))
		require.Len(t, errs, len(keys))
		for i, k := range keys {
			require.NoError(t, errs[i], k)
			require.True(t, res[i].Claimed, k)
			require.Zero(t, res[i].Existing, k)
			rec, err := b.store.Lookup(b.ctx, tx, "c", k)
			require.NoError(t, err)
			require.Equal(t, inboxdb.StatusDone, rec.Status)
			require.Equal(t, 1, rec.Attempts)
			require.NotNil(t, rec.ProcessedAt)
			_, err = b.store.Lookup(b.ctx, b.db, "c", k)
			require.ErrorIs(t, err, inboxdb.ErrNotFound, "an uncommitted claim is invisible to others")
		}

		// Rolled back: nothing left, the keys are free again.
		require.NoError(t, tx.Rollback())
		require.Zero(t, b.count(t, ""))

		res, errs = b.claimBatch(t, "c", keys...)
		for i := range keys {
			require.NoError(t, errs[i])
			require.True(t, res[i].Claimed)
		}
		require.Equal(t, int64(4), b.count(t, "status = 'done' AND attempts = 1 AND duplicates = 0"))

		// Committed: every later batch claim of them is a duplicate, counted.
		for round := int64(1); round <= 2; round++ {
			res, errs = b.claimBatch(t, "c", "m-2", "m-1", "m-20", "m-3")
			for i, k := range []string{"m-2", "m-1", "m-20", "m-3"} {
				require.NoError(t, errs[i])
				require.False(t, res[i].Claimed)
				require.Equal(t, k, res[i].Existing.Key, "results in the order the keys were given")
				require.Equal(t, "c", res[i].Existing.Consumer)
				require.Equal(t, inboxdb.StatusDone, res[i].Existing.Status)
				require.Equal(t, round, res[i].Existing.Duplicates, "the duplicate counter includes this delivery")
			}
		}

		// Keys are per consumer.
		res, errs = b.claimBatch(t, "other", "m-1", "m-2")
		require.Equal(t, []error{nil, nil}, errs)
		require.True(t, res[0].Claimed)
		require.True(t, res[1].Claimed)
	})
}

// TestClaimBatchTxMixed: new, done, parked, failed (released by an
// operator: claimed again in the transaction) and processing (lease mode:
// ErrNotDone) keys in one batch, given unsorted; the results come back in
// the order given; a rollback restores every record.
func TestClaimBatchTxMixed(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.insertRecord(t, "c", "a-done", inboxdb.StatusDone, 1, "")
		b.insertRecord(t, "c", "b-parked", inboxdb.StatusParked, 1, "400 invalid phone number")
		failedBefore := b.insertRecord(t, "c", "c-failed", inboxdb.StatusFailed, 2, "released by an operator")
		b.insertProcessing(t, "c", "d-processing")
		// Another consumer's records of the same keys are not touched.
		b.insertRecord(t, "other", "z-new", inboxdb.StatusDone, 1, "")

		keys := []string{"z-new", "d-processing", "a-done", "c-failed", "b-parked", "m-new"}
		tx := b.begin(t)
		res, errs, err := b.store.ClaimBatchTx(b.ctx, tx, "c", keys)
		require.NoError(t, err)
		require.Len(t, res, len(keys))
		require.Len(t, errs, len(keys))

		// z-new, m-new: claimed.
		for _, i := range []int{0, 5} {
			require.NoError(t, errs[i], keys[i])
			require.True(t, res[i].Claimed, keys[i])
		}
		// d-processing: a lease-mode record, an error of its own.
		require.ErrorIs(t, errs[1], inboxdb.ErrNotDone)
		require.ErrorContains(t, errs[1], "d-processing")
		require.False(t, res[1].Claimed)
		require.Equal(t, inboxdb.StatusProcessing, res[1].Existing.Status)
		require.Zero(t, res[1].Existing.Duplicates, "a processing record is not counted as a duplicate")
		// a-done: a duplicate, counted.
		require.NoError(t, errs[2])
		require.False(t, res[2].Claimed)
		require.Equal(t, "a-done", res[2].Existing.Key)
		require.Equal(t, inboxdb.StatusDone, res[2].Existing.Status)
		require.Equal(t, int64(1), res[2].Existing.Duplicates)
		// c-failed: released by an operator, claimed again in tx.
		require.NoError(t, errs[3])
		require.True(t, res[3].Claimed)
		inside, err := b.store.Lookup(b.ctx, tx, "c", "c-failed")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusDone, inside.Status)
		require.Equal(t, 3, inside.Attempts)
		require.Empty(t, inside.LastError)
		// b-parked: not run again, counted.
		require.NoError(t, errs[4])
		require.False(t, res[4].Claimed)
		require.Equal(t, "b-parked", res[4].Existing.Key)
		require.Equal(t, inboxdb.StatusParked, res[4].Existing.Status)
		require.Equal(t, "400 invalid phone number", res[4].Existing.LastError)
		require.Equal(t, int64(1), res[4].Existing.Duplicates)

		// Invisible to others before commit.
		outside, err := b.store.Lookup(b.ctx, b.db, "c", "c-failed")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusFailed, outside.Status)

		// The rollback restores every record.
		require.NoError(t, tx.Rollback())
		for _, k := range []string{"z-new", "m-new"} {
			_, err := b.store.Lookup(b.ctx, b.db, "c", k)
			require.ErrorIs(t, err, inboxdb.ErrNotFound, k)
		}
		rec, err := b.store.Lookup(b.ctx, b.db, "c", "c-failed")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusFailed, rec.Status)
		require.Equal(t, 2, rec.Attempts)
		require.Equal(t, "released by an operator", rec.LastError)
		require.True(t, failedBefore.ProcessedAt.Equal(*rec.ProcessedAt))
		for _, k := range []string{"a-done", "b-parked"} {
			rec, err := b.store.Lookup(b.ctx, b.db, "c", k)
			require.NoError(t, err)
			require.Zero(t, rec.Duplicates, "%s: a duplicate seen by a rolled-back batch is not counted", k)
		}
		rec, err = b.store.Lookup(b.ctx, b.db, "c", "d-processing")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusProcessing, rec.Status)

		// Committed: the claims hold.
		res, errs = b.claimBatch(t, "c", keys...)
		require.True(t, res[0].Claimed)
		require.True(t, res[3].Claimed)
		require.True(t, res[5].Claimed)
		require.ErrorIs(t, errs[1], inboxdb.ErrNotDone)
		require.Equal(t, int64(5), b.count(t, "consumer = 'c' AND status IN ('done', 'parked')"))
		rec, err = b.store.Lookup(b.ctx, b.db, "c", "c-failed")
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusDone, rec.Status)
		require.Equal(t, 3, rec.Attempts)
		rec, err = b.store.Lookup(b.ctx, b.db, "other", "z-new")
		require.NoError(t, err)
		require.Zero(t, rec.Duplicates, "another consumer's record is not touched")
	})
}

// TestClaimBatchTxWaitsForUncommittedClaims: a batch meeting another
// transaction's uncommitted claim of one of its keys waits for it, then sees
// a duplicate (committed) or claims the key (rolled back).
func TestClaimBatchTxWaitsForUncommittedClaims(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		for _, commit := range []bool{true, false} {
			prefix := map[bool]string{true: "commit-", false: "rollback-"}[commit]
			tx1 := b.begin(t)
			res, errs, err := b.store.ClaimBatchTx(b.ctx, tx1, "c", []string{prefix + "b"})
			require.NoError(t, err)
			require.NoError(t, errs[0])
			require.True(t, res[0].Claimed)
			tx2 := b.begin(t)
			pid2 := b.backendPID(t, tx2)
			done := make(chan batchOutcome, 1)
			go func() {
				res, errs, err := b.store.ClaimBatchTx(b.ctx, tx2, "c", []string{prefix + "c", prefix + "b", prefix + "a"})
				done <- batchOutcome{res, errs, err}
			}()
			b.awaitWaiting(t, pid2, "the batch should wait for the uncommitted claim")
			select {
			case o := <-done:
				t.Fatalf("the batch returned while the other claim was open: %+v", o)
			default:
			}
			if commit {
				require.NoError(t, tx1.Commit())
			} else {
				require.NoError(t, tx1.Rollback())
			}
			var o batchOutcome
			select {
			case o = <-done:
			case <-time.After(10 * time.Second):
				t.Fatal("the batch did not return within 10s after the other transaction ended")
			}
			require.NoError(t, o.err)
			require.Equal(t, []error{nil, nil, nil}, o.errs)
			require.True(t, o.res[0].Claimed)
			require.True(t, o.res[2].Claimed)
			require.Equal(t, !commit, o.res[1].Claimed, "committed elsewhere: a duplicate; rolled back: claimed here")
			require.NoError(t, tx2.Commit())
			require.Equal(t, int64(3), b.count(t, b.sql("message_key LIKE $1", "message_key LIKE ?"), prefix+"%"))
		}
	})
}

// TestClaimBatchTxNoDeadlock: two batches of the same keys given in
// opposite orders, both held up by a third transaction's uncommitted claim
// of the middle key. Inserting in the order given, the batch given
// [k2, k1, k0] would hold k2 and the batch given [k0, k1, k2] would hold k0
// while both wait for k1; once the third transaction rolls back, whichever
// takes k1 waits for the other's key: a deadlock (40P01), whatever the
// timing. Inserting in key order, the second batch holds nothing while it
// waits.
func TestClaimBatchTxNoDeadlock(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		blocker := b.begin(t)
		_, _, err := b.store.ClaimBatchTx(b.ctx, blocker, "c", []string{"k1"})
		require.NoError(t, err)

		txs := []wsql.Tx{b.begin(t), b.begin(t)}
		pids := []int{b.backendPID(t, txs[0]), b.backendPID(t, txs[1])}
		orders := [][]string{{"k2", "k1", "k0"}, {"k0", "k1", "k2"}}
		done := make(chan int, 2)
		outcomes := make([]batchOutcome, 2)
		for i := range txs {
			go func() {
				res, errs, err := b.store.ClaimBatchTx(b.ctx, txs[i], "c", orders[i])
				outcomes[i] = batchOutcome{res, errs, err}
				done <- i
			}()
			if i == 0 {
				b.awaitWaiting(t, pids[0], "the first batch should wait for the blocker's claim of k1")
			}
		}
		b.awaitWaiting(t, pids[1], "the second batch should wait too")
		require.NoError(t, blocker.Rollback())

		// The first batch to return won every key; the other waits for it.
		var first int
		select {
		case first = <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("no batch returned within 10s after the blocker rolled back")
		}
		o := outcomes[first]
		require.NoError(t, o.err, "no deadlock")
		for i := range 3 {
			require.NoError(t, o.errs[i])
			require.True(t, o.res[i].Claimed)
		}
		require.NoError(t, txs[first].Commit())
		var second int
		select {
		case second = <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("the second batch did not return within 10s after the first committed")
		}
		o = outcomes[second]
		require.NoError(t, o.err, "no deadlock")
		for i, k := range orders[second] {
			require.NoError(t, o.errs[i])
			require.False(t, o.res[i].Claimed, "%s: a duplicate of the first batch's claim", k)
			require.Equal(t, k, o.res[i].Existing.Key)
		}
		require.NoError(t, txs[second].Commit())
		require.Equal(t, int64(3), b.count(t, "duplicates = 1"))
	})
}

// TestClaimBatchTxVanished: a record deleted (Forget, Purge) between the
// batch's insert, which met it, and its update, which no longer finds it,
// is the key's own ErrVanished; the other keys are claimed. On MySQL the
// insert itself waits for the row lock (ON DUPLICATE KEY UPDATE locks the
// row it meets), and then inserts the key anew: claimed.
func TestClaimBatchTxVanished(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.insertRecord(t, "c", "v", inboxdb.StatusDone, 1, "")
		// The deleter locks the row first: the batch's insert meets it (a
		// lock is no conflict to wait for), its update waits for the lock.
		deleter := b.begin(t)
		var one int
		require.NoError(t, seam.QueryRow(b.ctx, deleter, "SELECT 1 FROM "+b.store.Table()+" WHERE consumer = 'c' AND message_key = 'v' FOR UPDATE", nil, &one))
		tx := b.begin(t)
		pid := b.backendPID(t, tx)
		done := make(chan batchOutcome, 1)
		go func() {
			res, errs, err := b.store.ClaimBatchTx(b.ctx, tx, "c", []string{"w", "v"})
			done <- batchOutcome{res, errs, err}
		}()
		b.awaitWaiting(t, pid, "the batch should wait for the deleter's row lock")
		_, err := deleter.ExecContext(b.ctx, "DELETE FROM "+b.store.Table()+" WHERE consumer = 'c' AND message_key = 'v'")
		require.NoError(t, err)
		require.NoError(t, deleter.Commit())
		var o batchOutcome
		select {
		case o = <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("the batch did not return")
		}
		require.NoError(t, o.err)
		require.NoError(t, o.errs[0])
		require.True(t, o.res[0].Claimed)
		if b.mysql() {
			require.NoError(t, o.errs[1])
			require.True(t, o.res[1].Claimed, "MySQL: the insert waited, and inserted the deleted key")
		} else {
			require.ErrorIs(t, o.errs[1], inboxdb.ErrVanished)
			require.False(t, o.res[1].Claimed)
		}
		require.NoError(t, tx.Commit())
	})
}

// TestClaimBatchCopiesTx: a batch that holds several deliveries of a key
// (group commit runs the handler for one, and reports the others as
// duplicates) counts them in the record, in the same transaction, as
// their own claims would have: copies-1 for a record it creates or a
// released one it claims again, copies for a done or parked one, nothing
// for a processing one. Rolled back, nothing is counted.
func TestClaimBatchCopiesTx(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		b.insertRecord(t, "c", "done", inboxdb.StatusDone, 1, "")
		b.insertRecord(t, "c", "parked", inboxdb.StatusParked, 1, "400 invalid phone number")
		b.insertRecord(t, "c", "released", inboxdb.StatusFailed, 2, "released by an operator")
		b.insertProcessing(t, "c", "processing")

		keys := []string{"new3", "done", "one", "parked", "released", "processing", "new2"}
		copies := []int{3, 2, 1, 4, 3, 2, 2}
		want := map[string]int64{"new3": 2, "done": 2, "one": 0, "parked": 4, "released": 2, "processing": 0, "new2": 1}
		claim := func() ([]inboxdb.ClaimResult, []error, wsql.Tx) {
			tx := b.begin(t)
			res, errs, err := b.store.ClaimBatchCopiesTx(b.ctx, tx, "c", keys, copies)
			require.NoError(t, err)
			return res, errs, tx
		}

		_, _, tx := claim()
		require.NoError(t, tx.Rollback())
		require.Zero(t, b.count(t, "duplicates <> 0"), "a rolled-back batch counts nothing")

		res, errs, tx := claim()
		for i, k := range keys {
			switch k {
			case "processing":
				require.ErrorIs(t, errs[i], inboxdb.ErrNotDone)
				continue
			case "new3", "one", "released", "new2":
				require.True(t, res[i].Claimed, k)
			default:
				require.False(t, res[i].Claimed, k)
				require.Equal(t, want[k], res[i].Existing.Duplicates, "%s: the record returned includes the copies", k)
			}
			require.NoError(t, errs[i], k)
		}
		require.NoError(t, tx.Commit())
		for k, n := range want {
			rec, err := b.store.Lookup(b.ctx, b.db, "c", k)
			require.NoError(t, err)
			require.Equal(t, n, rec.Duplicates, k)
		}

		// The same deliveries again: every key has a record now.
		res, errs, tx = claim()
		for i, k := range keys {
			if k == "processing" {
				require.ErrorIs(t, errs[i], inboxdb.ErrNotDone)
				continue
			}
			require.NoError(t, errs[i], k)
			require.False(t, res[i].Claimed, k)
			require.Equal(t, want[k]+int64(copies[i]), res[i].Existing.Duplicates, k)
		}
		require.NoError(t, tx.Commit())

		_, _, err := b.store.ClaimBatchCopiesTx(b.ctx, b.db, "c", keys, copies[:2])
		require.ErrorContains(t, err, "copy counts")
	})
}

// statementCounter counts the statements sent through it.
type statementCounter struct {
	wsql.ContextExecutor
	n int
}

func (c *statementCounter) ExecContext(ctx context.Context, q string, args ...any) (wsql.Result, error) {
	c.n++
	return c.ContextExecutor.ExecContext(ctx, q, args...)
}

func (c *statementCounter) QueryContext(ctx context.Context, q string, args ...any) (wsql.Rows, error) {
	c.n++
	return c.ContextExecutor.QueryContext(ctx, q, args...)
}

// TestClaimBatchCopiesCost: counting the copies costs nothing to a batch
// without copies, nor to a batch whose copies are of keys already
// recorded (the duplicates' UPDATE counts them); on the partitioned
// layout, whose claim function cannot count them, a batch that creates a
// record of a key with copies sends one more statement.
func TestClaimBatchCopiesCost(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		statements := func(prefix string, copies []int) int {
			t.Helper()
			tx := b.begin(t)
			c := &statementCounter{ContextExecutor: tx}
			keys := []string{prefix + "-a", prefix + "-b", prefix + "-c"}
			_, errs, err := b.store.ClaimBatchCopiesTx(b.ctx, c, "c", keys, copies)
			require.NoError(t, err)
			require.Equal(t, []error{nil, nil, nil}, errs)
			require.NoError(t, tx.Commit())
			return c.n
		}
		statements("warm-up", nil) // the store's look-ups of the layout
		plain := statements("new", nil)
		require.Equal(t, plain, statements("new1", []int{1, 1, 1}), "copy counts of 1 are no copies")
		withCopies := statements("newc", []int{1, 3, 1})
		if b.tables.Partitions != nil {
			require.Equal(t, plain+1, withCopies, "partitioned: one UPDATE counts the copies of the records created")
		} else {
			require.Equal(t, plain, withCopies, "plain: the INSERT counts them")
		}
		dups := statements("new", nil)
		require.Equal(t, dups, statements("new", []int{2, 1, 3}), "copies of recorded keys: the same statements")
	})
}
