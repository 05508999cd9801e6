package inboxdb_test

import (
	"context"
	stdsql "database/sql"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// leaseSlack is the tolerance when comparing a lease end computed by the
// database's clock (PostgreSQL's now(), MySQL's UTC_TIMESTAMP(6)) with the
// test's (same host).
const leaseSlack = 2 * time.Second

// The two MaxInterrupted settings the tests claim with: retryExpired runs a
// key whose lease expired again, without bound; parkExpired parks it at its
// first interrupted attempt (what the removed ParkExpired policy did).
const (
	retryExpired = 0
	parkExpired  = 1
)

// leaseOutcome is what one concurrent ClaimLease returned.
type leaseOutcome struct {
	lc  inboxdb.LeaseClaim
	err error
}

func leaseClaim(t *testing.T, b bundle, consumer, key string, lease time.Duration, maxInterrupted int) inboxdb.LeaseClaim {
	t.Helper()
	lc, err := b.store.ClaimLease(b.ctx, b.db, consumer, key, inboxdb.LeaseOptions{Lease: lease, MaxInterrupted: maxInterrupted})
	require.NoError(t, err)
	return lc
}

// leaseAcquire claims a key that must be acquired and checks that its lease
// ends lease from now.
func leaseAcquire(t *testing.T, b bundle, consumer, key string, lease time.Duration, maxInterrupted int) inboxdb.LeaseClaim {
	t.Helper()
	before := time.Now()
	lc := leaseClaim(t, b, consumer, key, lease, maxInterrupted)
	after := time.Now()
	require.Equal(t, inboxdb.LeaseAcquired, lc.Outcome, "%s/%s", consumer, key)
	leaseAround(t, lc.LeaseUntil, before, after, lease)
	require.Equal(t, inboxdb.StatusProcessing, lc.Record.Status)
	require.Equal(t, lc.Attempt, lc.Record.Attempts)
	require.NotNil(t, lc.Record.LeaseUntil)
	require.True(t, lc.LeaseUntil.Equal(*lc.Record.LeaseUntil))
	require.False(t, lc.ParkedNow)
	return lc
}

func leaseLookup(t *testing.T, b bundle, consumer, key string) inboxdb.Record {
	t.Helper()
	rec, err := b.store.Lookup(b.ctx, b.db, consumer, key)
	require.NoError(t, err)
	return rec
}

// leaseAround asserts that got is d after a moment between before and after.
func leaseAround(t *testing.T, got, before, after time.Time, d time.Duration) {
	t.Helper()
	require.WithinRange(t, got, before.Add(d-leaseSlack), after.Add(d+leaseSlack), "lease end should be now + %s", d)
}

// leaseExpire moves the live lease of a processing key into the past, as if
// its holder had died mid-attempt.
func leaseExpire(t *testing.T, b bundle, consumer, key string) {
	t.Helper()
	require.Equal(t, int64(1), b.exec(t, "UPDATE "+b.store.Table()+b.sql(
		" SET lease_until = now() - interval '1 second' WHERE consumer = $1 AND message_key = $2 AND status = 'processing'",
		" SET lease_until = UTC_TIMESTAMP(6) - INTERVAL 1 SECOND WHERE consumer = ? AND message_key = ? AND status = 'processing'"),
		consumer, key))
}

// leaseComplete records the attempt fenced by token as done in a
// transaction of its own.
func leaseComplete(t *testing.T, b bundle, consumer, key, token string) {
	t.Helper()
	tx := b.begin(t)
	require.NoError(t, b.store.CompleteTx(b.ctx, tx, consumer, key, token))
	require.NoError(t, tx.Commit())
}

// leaseSame asserts that a record did not change.
func leaseSame(t *testing.T, want, got inboxdb.Record) {
	t.Helper()
	require.Equal(t, want.Status, got.Status)
	require.Equal(t, want.Attempts, got.Attempts)
	require.Equal(t, want.Duplicates, got.Duplicates)
	require.Equal(t, want.LastError, got.LastError)
	require.Equal(t, want.LeaseUntil == nil, got.LeaseUntil == nil)
	if want.LeaseUntil != nil {
		require.True(t, want.LeaseUntil.Equal(*got.LeaseUntil), "lease_until moved: %v -> %v", *want.LeaseUntil, *got.LeaseUntil)
	}
	require.Equal(t, want.ProcessedAt == nil, got.ProcessedAt == nil)
}

func TestLeaseOutcomeString(t *testing.T) {
	t.Parallel()
	require.Equal(t, "acquired", inboxdb.LeaseAcquired.String())
	require.Equal(t, "duplicate", inboxdb.LeaseDuplicate.String())
	require.Equal(t, "busy", inboxdb.LeaseBusy.String())
	require.Equal(t, "parked", inboxdb.LeaseParked.String())
	require.Equal(t, "unknown", inboxdb.LeaseOutcome(0).String())
}

func TestLeaseClaimStates(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		const c = "c"
		const lease = time.Hour

		t.Run("new key", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "k-new", lease, retryExpired)
			require.Equal(t, 1, lc.Attempt)
			require.False(t, lc.Interrupted)
			require.Equal(t, c, lc.Record.Consumer)
			require.Equal(t, "k-new", lc.Record.Key)
			require.Zero(t, lc.Record.Duplicates)
			require.Nil(t, lc.Record.ProcessedAt)
			require.Empty(t, lc.Record.LastError)

			rec := leaseLookup(t, b, c, "k-new")
			require.Equal(t, inboxdb.StatusProcessing, rec.Status, "the claim is committed before ClaimLease returns")
			require.True(t, lc.LeaseUntil.Equal(*rec.LeaseUntil))

			// The same key of another consumer is another record.
			require.Equal(t, 1, leaseAcquire(t, b, "other", "k-new", lease, retryExpired).Attempt)
		})

		t.Run("live lease is busy", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "k-busy", lease, retryExpired)
			before := leaseLookup(t, b, c, "k-busy")
			for _, maxInterrupted := range []int{retryExpired, parkExpired, retryExpired} {
				busy := leaseClaim(t, b, c, "k-busy", 5*time.Minute, maxInterrupted)
				require.Equal(t, inboxdb.LeaseBusy, busy.Outcome)
				require.Equal(t, 1, busy.Attempt)
				require.False(t, busy.Interrupted)
				require.False(t, busy.ParkedNow)
				require.True(t, lc.LeaseUntil.Equal(busy.LeaseUntil), "busy reports the holder's lease end")
				require.Equal(t, inboxdb.StatusProcessing, busy.Record.Status)
			}
			leaseSame(t, before, leaseLookup(t, b, c, "k-busy"))
			require.Zero(t, leaseLookup(t, b, c, "k-busy").Duplicates, "busy is not a duplicate")
		})

		t.Run("done is a duplicate", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "k-done", lease, retryExpired)
			leaseComplete(t, b, c, "k-done", lc.Token)
			for i, maxInterrupted := range []int{retryExpired, parkExpired, retryExpired} {
				dup := leaseClaim(t, b, c, "k-done", lease, maxInterrupted)
				require.Equal(t, inboxdb.LeaseDuplicate, dup.Outcome)
				require.Equal(t, 1, dup.Attempt)
				require.True(t, dup.LeaseUntil.IsZero())
				require.Equal(t, inboxdb.StatusDone, dup.Record.Status)
				require.Equal(t, "k-done", dup.Record.Key)
				require.Equal(t, int64(i+1), dup.Record.Duplicates, "the duplicate counter includes this delivery")
				require.NotNil(t, dup.Record.ProcessedAt)
				require.Nil(t, dup.Record.LeaseUntil)
			}
			rec := leaseLookup(t, b, c, "k-done")
			require.Equal(t, int64(3), rec.Duplicates)
			require.Equal(t, inboxdb.StatusDone, rec.Status)
		})

		t.Run("failed runs again", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "k-failed", lease, retryExpired)
			for attempt := 2; attempt <= 4; attempt++ {
				require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "k-failed", Token: lc.Token}, "boom", false))
				maxInterrupted := retryExpired
				if attempt%2 == 1 {
					maxInterrupted = parkExpired // the bound is for expired leases only
				}
				lc = leaseAcquire(t, b, c, "k-failed", lease, maxInterrupted)
				require.Equal(t, attempt, lc.Attempt)
				require.False(t, lc.Interrupted, "a failed attempt ended: it was not interrupted")
				require.Zero(t, lc.Record.Duplicates)
			}
			require.Equal(t, 4, leaseLookup(t, b, c, "k-failed").Attempts)
		})

		t.Run("expired lease, retried", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "k-retry", lease, retryExpired)
			for attempt := 2; attempt <= 3; attempt++ {
				leaseExpire(t, b, c, "k-retry")
				next := leaseAcquire(t, b, c, "k-retry", lease, retryExpired)
				require.Equal(t, attempt, next.Attempt)
				require.True(t, next.Interrupted)
				require.True(t, next.LeaseUntil.After(lc.LeaseUntil.Add(-time.Second)))
				require.Zero(t, next.Record.Duplicates)

				busy := leaseClaim(t, b, c, "k-retry", lease, retryExpired)
				require.Equal(t, inboxdb.LeaseBusy, busy.Outcome, "the new lease is live")
				require.Equal(t, attempt, busy.Attempt)
				lc = next
			}
		})

		t.Run("processing without a lease end counts as expired", func(t *testing.T) {
			b.exec(t, "INSERT INTO "+b.store.Table()+b.sql(
				" (consumer, message_key, status, attempts, lease_until) VALUES ($1, 'k-null', 'processing', 1, NULL)",
				" (consumer, message_key, status, attempts, lease_until, first_seen_at) VALUES (?, 'k-null', 'processing', 1, NULL, UTC_TIMESTAMP(6))"), c)
			lc := leaseAcquire(t, b, c, "k-null", lease, retryExpired)
			require.Equal(t, 2, lc.Attempt)
			require.True(t, lc.Interrupted)
		})

		t.Run("expired lease, parked at the first interruption", func(t *testing.T) {
			leaseAcquire(t, b, c, "k-park", lease, parkExpired)
			leaseExpire(t, b, c, "k-park")

			parked := leaseClaim(t, b, c, "k-park", lease, parkExpired)
			require.Equal(t, inboxdb.LeaseParked, parked.Outcome)
			require.True(t, parked.ParkedNow)
			require.False(t, parked.Interrupted)
			require.Equal(t, 1, parked.Attempt, "parking does not start an attempt")
			require.True(t, parked.LeaseUntil.IsZero())
			require.Equal(t, inboxdb.StatusParked, parked.Record.Status)
			require.Nil(t, parked.Record.LeaseUntil)
			require.Zero(t, parked.Record.Duplicates)
			require.Contains(t, parked.Record.LastError, "lease expired")
			require.Contains(t, parked.Record.LastError, "attempt 1")

			for i, maxInterrupted := range []int{parkExpired, retryExpired} {
				again := leaseClaim(t, b, c, "k-park", lease, maxInterrupted)
				require.Equal(t, inboxdb.LeaseParked, again.Outcome)
				require.False(t, again.ParkedNow, "parked earlier, not now")
				require.Equal(t, 1, again.Attempt)
				require.Equal(t, int64(i+1), again.Record.Duplicates)
				require.Equal(t, parked.Record.LastError, again.Record.LastError)
			}
			rec := leaseLookup(t, b, c, "k-park")
			require.Equal(t, inboxdb.StatusParked, rec.Status)
			require.Equal(t, int64(2), rec.Duplicates)
		})
	})
}

func TestLeaseClaimInvalid(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		for _, tc := range []struct {
			name          string
			consumer, key string
			want          error
		}{
			{"empty key", "c", "", inboxdb.ErrEmptyKey},
			{"empty consumer", "", "k", inboxdb.ErrEmptyConsumer},
			{"too long", "c", strings.Repeat("k", inboxdb.DefaultMaxKeyLength+1), inboxdb.ErrKeyTooLong},
			{"invalid UTF-8", "c", "k\xff", inboxdb.ErrInvalidKey},
			{"NUL byte", "c", "a\x00b", inboxdb.ErrInvalidKey},
			{"consumer with NUL byte", "c\x00", "k", inboxdb.ErrInvalidKey},
		} {
			lc, err := b.store.ClaimLease(b.ctx, b.db, tc.consumer, tc.key, inboxdb.LeaseOptions{Lease: time.Minute})
			require.ErrorIs(t, err, tc.want, tc.name)
			require.Zero(t, lc, tc.name)
		}
		for _, lease := range []time.Duration{0, -time.Second} {
			lc, err := b.store.ClaimLease(b.ctx, b.db, "c", "k", inboxdb.LeaseOptions{Lease: lease})
			require.Error(t, err, "lease %s", lease)
			require.Contains(t, err.Error(), "lease must be > 0")
			require.Zero(t, lc)
		}
		require.Zero(t, b.count(t, ""), "rejected claims write nothing")

		// The longest valid key works.
		leaseAcquire(t, b, "c", strings.Repeat("k", inboxdb.DefaultMaxKeyLength), time.Minute, retryExpired)
	})
}

func TestLeaseClaimConcurrent(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		const n = 10
		// race runs n ClaimLease calls of key at once.
		race := func(t *testing.T, key string, maxInterrupted int) []leaseOutcome {
			t.Helper()
			start := make(chan struct{})
			out := make([]leaseOutcome, n)
			var wg sync.WaitGroup
			for i := range out {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					lc, err := b.store.ClaimLease(b.ctx, b.db, "c", key, inboxdb.LeaseOptions{Lease: time.Hour, MaxInterrupted: maxInterrupted})
					out[i] = leaseOutcome{lc, err}
				}()
			}
			close(start)
			wg.Wait() // bounded by b.ctx
			for _, o := range out {
				require.NoError(t, o.err)
			}
			return out
		}
		split := func(out []leaseOutcome, o inboxdb.LeaseOutcome) (match, rest []inboxdb.LeaseClaim) {
			for _, x := range out {
				if x.lc.Outcome == o {
					match = append(match, x.lc)
				} else {
					rest = append(rest, x.lc)
				}
			}
			return match, rest
		}

		t.Run("new key", func(t *testing.T) {
			won, lost := split(race(t, "k-new", retryExpired), inboxdb.LeaseAcquired)
			require.Len(t, won, 1, "exactly one worker acquires")
			require.Equal(t, 1, won[0].Attempt)
			for _, lc := range lost {
				require.Equal(t, inboxdb.LeaseBusy, lc.Outcome)
				require.Equal(t, 1, lc.Attempt)
				require.True(t, won[0].LeaseUntil.Equal(lc.LeaseUntil), "busy reports the winner's lease")
			}
			rec := leaseLookup(t, b, "c", "k-new")
			require.Equal(t, 1, rec.Attempts)
			require.Zero(t, rec.Duplicates)
		})

		t.Run("expired lease, retried", func(t *testing.T) {
			leaseAcquire(t, b, "c", "k-retry", time.Hour, retryExpired)
			leaseExpire(t, b, "c", "k-retry")
			won, lost := split(race(t, "k-retry", retryExpired), inboxdb.LeaseAcquired)
			require.Len(t, won, 1, "exactly one worker takes the expired key over")
			require.Equal(t, 2, won[0].Attempt)
			require.True(t, won[0].Interrupted)
			for _, lc := range lost {
				require.Equal(t, inboxdb.LeaseBusy, lc.Outcome)
				require.Equal(t, 2, lc.Attempt)
				require.True(t, won[0].LeaseUntil.Equal(lc.LeaseUntil))
			}
			require.Equal(t, 2, leaseLookup(t, b, "c", "k-retry").Attempts)
		})

		t.Run("expired lease, parked at the first interruption", func(t *testing.T) {
			leaseAcquire(t, b, "c", "k-park", time.Hour, parkExpired)
			leaseExpire(t, b, "c", "k-park")
			out := race(t, "k-park", parkExpired)
			now := 0
			for _, o := range out {
				require.Equal(t, inboxdb.LeaseParked, o.lc.Outcome)
				require.Equal(t, 1, o.lc.Attempt)
				if o.lc.ParkedNow {
					now++
				}
			}
			require.Equal(t, 1, now, "exactly one worker parks the key")
			rec := leaseLookup(t, b, "c", "k-park")
			require.Equal(t, inboxdb.StatusParked, rec.Status)
			require.Equal(t, int64(n-1), rec.Duplicates)
		})
	})
}

// A completion transaction that holds the row serialises with a takeover of
// the same key: the claim waits, then sees the outcome.
func TestLeaseClaimWaitsForCompletion(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		for _, commit := range []bool{true, false} {
			key := "k-rollback"
			if commit {
				key = "k-commit"
			}
			t.Run(key, func(t *testing.T) {
				first := leaseAcquire(t, b, "c", key, time.Hour, retryExpired)
				leaseExpire(t, b, "c", key)

				tx := b.begin(t)
				require.NoError(t, b.store.CompleteTx(b.ctx, tx, "c", key, first.Token),
					"an expired lease nobody took over still owns the key")
				var pid int
				require.NoError(t, seam.QueryRow(b.ctx, tx, b.sql("SELECT pg_backend_pid()", "SELECT CONNECTION_ID()"), nil, &pid))

				done := make(chan leaseOutcome, 1)
				go func() {
					lc, err := b.store.ClaimLease(b.ctx, b.db, "c", key, inboxdb.LeaseOptions{Lease: time.Hour})
					done <- leaseOutcome{lc, err}
				}()
				testenv.Eventually(t, 10*time.Second, func() bool {
					var n int
					q, args := "SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid))", []any{pid}
					if b.mysql() {
						// The claim's insert of this test's table is
						// running (MariaDB does not list a lock wait of a
						// transaction that has not written yet in
						// INNODB_LOCK_WAITS).
						q, args = "SELECT count(*) FROM information_schema.PROCESSLIST WHERE id NOT IN (?, CONNECTION_ID()) AND info LIKE ?",
							[]any{pid, "%INSERT INTO " + b.store.Table() + "%"}
					}
					err := seam.QueryRow(b.ctx, b.db, q, args, &n)
					return err == nil && n == 1
				}, "the takeover should wait for the completion transaction")
				select {
				case o := <-done:
					t.Fatalf("the takeover returned while the completion was open: %+v, %v", o.lc, o.err)
				default:
				}

				if commit {
					require.NoError(t, tx.Commit())
				} else {
					require.NoError(t, tx.Rollback())
				}
				var o leaseOutcome
				select {
				case o = <-done:
				case <-time.After(10 * time.Second):
					t.Fatal("the takeover did not return within 10s after the completion ended")
				}
				require.NoError(t, o.err)
				if commit {
					require.Equal(t, inboxdb.LeaseDuplicate, o.lc.Outcome, "the completion committed first")
					require.Equal(t, 1, o.lc.Attempt)
					require.Equal(t, int64(1), o.lc.Record.Duplicates)
				} else {
					require.Equal(t, inboxdb.LeaseAcquired, o.lc.Outcome, "the completion rolled back: the key is taken over")
					require.Equal(t, 2, o.lc.Attempt)
					require.True(t, o.lc.Interrupted)
				}
			})
		}
	})
}

// A transaction that keeps holding the row (a live holder extending its
// lease inside its completion transaction while it works) keeps takeovers
// off the key even after lease_until passed: the claim waits about a second,
// then reports busy, never taking the key over and never waiting for as
// long as the holder works.
func TestLeaseClaimBusyWhileRowHeld(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		first := leaseAcquire(t, b, "c", "k", time.Hour, retryExpired)
		leaseExpire(t, b, "c", "k")
		tx := b.begin(t)
		_, err := b.store.ExtendLease(b.ctx, tx, "c", "k", first.Token, time.Millisecond)
		require.NoError(t, err)

		start := time.Now()
		lc := leaseClaim(t, b, "c", "k", time.Hour, retryExpired)
		took := time.Since(start)
		require.Equal(t, inboxdb.LeaseBusy, lc.Outcome, "the holder's row lock says it is alive")
		require.GreaterOrEqual(t, took, 900*time.Millisecond, "the claim waits for a short completion first")
		require.Less(t, took, 5*time.Second, "and never for as long as the holder works")
		require.Equal(t, 1, leaseLookup(t, b, "c", "k").Attempts, "not taken over")

		require.NoError(t, tx.Commit())
		time.Sleep(5 * time.Millisecond) // the 1 ms extension is over
		lc = leaseAcquire(t, b, "c", "k", time.Hour, retryExpired)
		require.Equal(t, 2, lc.Attempt, "once the holder let go and its lease ended, the key is taken over")
		require.True(t, lc.Interrupted)
	})
}

// A stale attempt whose completion transaction took its snapshot while it
// still owned the key (it read the record first) is refused once another
// worker took the key over: its extension and completion read the latest
// record, not the snapshot (MariaDB's default isolation is REPEATABLE
// READ, where only locking reads see the takeover).
func TestLeaseStaleSnapshotIsFenced(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		const c, k = "c", "k"
		stale := leaseAcquire(t, b, c, k, time.Hour, retryExpired)
		tx := b.begin(t)
		rec, err := b.store.Lookup(b.ctx, tx, c, k)
		require.NoError(t, err)
		require.Equal(t, inboxdb.StatusProcessing, rec.Status, "the snapshot sees the attempt's own claim")

		leaseExpire(t, b, c, k)
		holder := leaseAcquire(t, b, c, k, time.Hour, retryExpired)
		require.Equal(t, 2, holder.Attempt)

		_, err = b.store.ExtendLease(b.ctx, tx, c, k, stale.Token, time.Hour)
		require.ErrorIs(t, err, inboxdb.ErrLeaseLost, "the extension of the stale attempt")
		require.ErrorIs(t, b.store.CompleteTx(b.ctx, tx, c, k, stale.Token), inboxdb.ErrLeaseLost, "the completion of the stale attempt")
		require.NoError(t, tx.Rollback())
		rec = leaseLookup(t, b, c, k)
		require.Equal(t, inboxdb.StatusProcessing, rec.Status)
		require.True(t, holder.LeaseUntil.Equal(*rec.LeaseUntil), "the holder's lease is untouched")
		leaseComplete(t, b, c, k, holder.Token)
	})
}

// On MySQL a claim waits at most a second for a record another
// transaction holds through the session's innodb_lock_wait_timeout, and
// puts the session's own value back before it returns, whatever the
// outcome, also when its context ends: the connection goes back to the
// pool as it came.
func TestLeaseClaimKeepsTheSessionLockWait(t *testing.T) {
	t.Parallel()
	// Every session of this pool starts with 7 (a system variable in the
	// DSN), and there is one session at a time.
	one := testenv.MySQLDBFor(t, testenv.MySQLDSN(testenv.MySQLURL())+"&innodb_lock_wait_timeout=7")
	one.SetMaxOpenConns(1)
	b := newBundle(t, testenv.Driver{Name: testenv.MariaDB, DB: wsql.BeginnerFromStdSQL(one), Dialect: sqlschema.MySQL}, "plain")
	other := wsql.BeginnerFromStdSQL(testenv.MySQLDB(t))
	sessionWait := func() int {
		var n int
		require.NoError(t, seam.QueryRow(b.ctx, b.db, "SELECT @@SESSION.innodb_lock_wait_timeout", nil, &n))
		return n
	}
	require.Equal(t, 7, sessionWait())

	first := leaseAcquire(t, b, "c", "k", time.Hour, retryExpired)
	require.Equal(t, 7, sessionWait(), "after an acquired claim")
	require.Equal(t, inboxdb.LeaseBusy, leaseClaim(t, b, "c", "k", time.Hour, retryExpired).Outcome)
	require.Equal(t, 7, sessionWait(), "after a busy claim")

	// The claim's context ends right after the session's setting changed:
	// it is put back all the same.
	ctx, cancel := context.WithCancel(b.ctx)
	_, err := b.store.ClaimLease(ctx, cancelAfter{Beginner: b.db, match: "innodb_lock_wait_timeout = 1", cancel: cancel},
		"c", "k", inboxdb.LeaseOptions{Lease: time.Hour})
	require.ErrorIs(t, err, context.Canceled)
	require.Equal(t, 7, sessionWait(), "after a claim whose context ended")

	// Another session holds the record: the claim gives up after about a
	// second (not the session's 7), busy.
	leaseExpire(t, b, "c", "k")
	tx, err := other.BeginTx(b.ctx, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback() })
	_, err = b.store.ExtendLease(b.ctx, tx, "c", "k", first.Token, time.Millisecond)
	require.NoError(t, err)
	start := time.Now()
	require.Equal(t, inboxdb.LeaseBusy, leaseClaim(t, b, "c", "k", time.Hour, retryExpired).Outcome)
	require.Less(t, time.Since(start), 5*time.Second)
	require.Equal(t, 7, sessionWait(), "after a claim that waited")

	// Its context ends while it waits: the driver drops the session.
	ctx, cancel = context.WithTimeout(b.ctx, 200*time.Millisecond)
	defer cancel()
	_, err = b.store.ClaimLease(ctx, b.db, "c", "k", inboxdb.LeaseOptions{Lease: time.Hour})
	require.Error(t, err)
	require.Equal(t, 7, sessionWait(), "after a claim interrupted while it waited")
	require.NoError(t, tx.Rollback())
}

// cancelAfter is a database whose transactions call cancel once they ran
// a statement containing match, and give database/sql a moment to act on
// it.
type cancelAfter struct {
	wsql.Beginner
	match  string
	cancel context.CancelFunc
}

func (c cancelAfter) BeginTx(ctx context.Context, opts *stdsql.TxOptions) (wsql.Tx, error) {
	tx, err := c.Beginner.BeginTx(ctx, opts)
	if err != nil {
		return nil, err
	}
	return cancelAfterTx{Tx: tx, c: c}, nil
}

type cancelAfterTx struct {
	wsql.Tx
	c cancelAfter
}

func (t cancelAfterTx) ExecContext(ctx context.Context, q string, args ...any) (wsql.Result, error) {
	res, err := t.Tx.ExecContext(ctx, q, args...)
	if strings.Contains(q, t.c.match) {
		t.c.cancel()
		// database/sql rolls a transaction bound to the context back on
		// its own goroutine: give it the time to.
		time.Sleep(50 * time.Millisecond)
	}
	return res, err
}

func TestLeaseExtend(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		const c, k = "c", "k"
		lc := leaseAcquire(t, b, c, k, 10*time.Second, retryExpired)

		for _, lease := range []time.Duration{time.Hour, 30 * time.Second, 1500 * time.Millisecond, 2 * time.Hour} {
			before := time.Now()
			until, err := b.store.ExtendLease(b.ctx, b.db, c, k, lc.Token, lease)
			after := time.Now()
			require.NoError(t, err)
			leaseAround(t, until, before, after, lease)
			rec := leaseLookup(t, b, c, k)
			require.True(t, until.Equal(*rec.LeaseUntil), "the returned end is the stored one")
			require.Equal(t, inboxdb.StatusProcessing, rec.Status)
			require.Equal(t, 1, rec.Attempts)
		}
		extended := leaseLookup(t, b, c, k)
		busy := leaseClaim(t, b, c, k, time.Minute, retryExpired)
		require.Equal(t, inboxdb.LeaseBusy, busy.Outcome)
		require.True(t, extended.LeaseUntil.Equal(busy.LeaseUntil), "others see the extended lease")

		// Invalid leases and wrong tokens change nothing.
		for _, lease := range []time.Duration{0, -time.Minute} {
			until, err := b.store.ExtendLease(b.ctx, b.db, c, k, lc.Token, lease)
			require.Error(t, err)
			require.NotErrorIs(t, err, inboxdb.ErrLeaseLost)
			require.Contains(t, err.Error(), "lease must be > 0")
			require.True(t, until.IsZero())
		}
		for _, token := range wrongTokens(lc.Token) {
			until, err := b.store.ExtendLease(b.ctx, b.db, c, k, token, time.Hour)
			require.ErrorIs(t, err, inboxdb.ErrLeaseLost, "token %q", token)
			require.True(t, until.IsZero())
		}
		_, err := b.store.ExtendLease(b.ctx, b.db, c, "no-such-key", lc.Token, time.Hour)
		require.ErrorIs(t, err, inboxdb.ErrLeaseLost)
		_, err = b.store.ExtendLease(b.ctx, b.db, "other", k, lc.Token, time.Hour)
		require.ErrorIs(t, err, inboxdb.ErrLeaseLost)
		leaseSame(t, extended, leaseLookup(t, b, c, k))

		// An expired lease nobody took over can still be extended.
		leaseExpire(t, b, c, k)
		_, err = b.store.ExtendLease(b.ctx, b.db, c, k, lc.Token, time.Hour)
		require.NoError(t, err)
		require.Equal(t, inboxdb.LeaseBusy, leaseClaim(t, b, c, k, time.Hour, retryExpired).Outcome)

		// Taken over: the old attempt lost the key, the new one extends.
		leaseExpire(t, b, c, k)
		old := lc
		lc = leaseAcquire(t, b, c, k, time.Minute, retryExpired)
		require.Equal(t, 2, lc.Attempt)
		require.NotEqual(t, old.Token, lc.Token, "every claim has its own token")
		_, err = b.store.ExtendLease(b.ctx, b.db, c, k, old.Token, time.Hour)
		require.ErrorIs(t, err, inboxdb.ErrLeaseLost)
		require.True(t, lc.LeaseUntil.Equal(*leaseLookup(t, b, c, k).LeaseUntil), "the new holder's lease is untouched")
		_, err = b.store.ExtendLease(b.ctx, b.db, c, k, lc.Token, time.Hour)
		require.NoError(t, err)

		// Not processing: failed, done, parked.
		require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: k, Token: lc.Token}, "boom", false))
		_, err = b.store.ExtendLease(b.ctx, b.db, c, k, lc.Token, time.Hour)
		require.ErrorIs(t, err, inboxdb.ErrLeaseLost, "failed")
		require.Nil(t, leaseLookup(t, b, c, k).LeaseUntil)

		lc = leaseAcquire(t, b, c, k, time.Minute, retryExpired)
		leaseComplete(t, b, c, k, lc.Token)
		_, err = b.store.ExtendLease(b.ctx, b.db, c, k, lc.Token, time.Hour)
		require.ErrorIs(t, err, inboxdb.ErrLeaseLost, "done")
		require.Nil(t, leaseLookup(t, b, c, k).LeaseUntil)

		lc = leaseAcquire(t, b, c, "k-parked", time.Minute, retryExpired)
		require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "k-parked", Token: lc.Token}, "permanent", true))
		_, err = b.store.ExtendLease(b.ctx, b.db, c, "k-parked", lc.Token, time.Hour)
		require.ErrorIs(t, err, inboxdb.ErrLeaseLost, "parked")
		require.Nil(t, leaseLookup(t, b, c, "k-parked").LeaseUntil)
	})
}

func TestLeaseCompleteTx(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		const c = "c"
		effects := b.tables.Dialect.QuoteIdentifier(b.tables.Schema, "lease_effects")
		b.exec(t, "CREATE TABLE "+effects+b.sql(" (k text PRIMARY KEY)", " (k VARCHAR(64) PRIMARY KEY)"))

		t.Run("commit", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "k", time.Hour, retryExpired)
			require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "k", Token: lc.Token}, "boom", false))
			lc = leaseAcquire(t, b, c, "k", time.Hour, retryExpired)
			require.Equal(t, 2, lc.Attempt)
			require.Equal(t, "boom", leaseLookup(t, b, c, "k").LastError, "precondition: an error to clear")

			tx := b.begin(t)
			_, err := tx.ExecContext(b.ctx, "INSERT INTO "+effects+" VALUES ('k')")
			require.NoError(t, err)
			require.NoError(t, b.store.CompleteTx(b.ctx, tx, c, "k", lc.Token))

			inside, err := b.store.Lookup(b.ctx, tx, c, "k")
			require.NoError(t, err)
			require.Equal(t, inboxdb.StatusDone, inside.Status)
			outside := leaseLookup(t, b, c, "k")
			require.Equal(t, inboxdb.StatusProcessing, outside.Status, "invisible to others before commit")
			require.NotNil(t, outside.LeaseUntil)

			before := time.Now()
			require.NoError(t, tx.Commit())
			rec := leaseLookup(t, b, c, "k")
			require.Equal(t, inboxdb.StatusDone, rec.Status)
			require.Equal(t, 2, rec.Attempts)
			require.NotNil(t, rec.ProcessedAt)
			require.WithinRange(t, *rec.ProcessedAt, before.Add(-time.Minute), time.Now().Add(leaseSlack))
			require.Nil(t, rec.LeaseUntil, "the lease is cleared")
			require.Empty(t, rec.LastError, "the previous attempt's error is cleared")
			require.Equal(t, int64(1), b.count(t, b.sql("consumer = $1", "consumer = ?")+" AND message_key = 'k'", c))
			require.Equal(t, []string{"k"}, b.strings(t, "SELECT k FROM "+effects+" WHERE k = 'k'"), "the handler's write committed with it")

			// Done: a second completion of the attempt is refused.
			tx = b.begin(t)
			require.ErrorIs(t, b.store.CompleteTx(b.ctx, tx, c, "k", lc.Token), inboxdb.ErrLeaseLost)
			require.NoError(t, tx.Rollback())
		})

		t.Run("rollback", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "k-rb", time.Hour, retryExpired)
			before := leaseLookup(t, b, c, "k-rb")
			tx := b.begin(t)
			_, err := tx.ExecContext(b.ctx, "INSERT INTO "+effects+" VALUES ('k-rb')")
			require.NoError(t, err)
			require.NoError(t, b.store.CompleteTx(b.ctx, tx, c, "k-rb", lc.Token))
			require.NoError(t, tx.Rollback())

			leaseSame(t, before, leaseLookup(t, b, c, "k-rb"))
			require.Empty(t, b.strings(t, "SELECT k FROM "+effects+" WHERE k = 'k-rb'"))
			require.Equal(t, inboxdb.LeaseBusy, leaseClaim(t, b, c, "k-rb", time.Hour, retryExpired).Outcome,
				"still processing under the same lease")

			// The attempt still owns the key and can complete later.
			leaseComplete(t, b, c, "k-rb", lc.Token)
			require.Equal(t, inboxdb.StatusDone, leaseLookup(t, b, c, "k-rb").Status)
		})

		t.Run("wrong token", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "k-wrong", time.Hour, retryExpired)
			before := leaseLookup(t, b, c, "k-wrong")
			tx := b.begin(t)
			for _, token := range wrongTokens(lc.Token) {
				require.ErrorIs(t, b.store.CompleteTx(b.ctx, tx, c, "k-wrong", token), inboxdb.ErrLeaseLost, "token %q", token)
			}
			require.ErrorIs(t, b.store.CompleteTx(b.ctx, tx, "other", "k-wrong", lc.Token), inboxdb.ErrLeaseLost)
			require.ErrorIs(t, b.store.CompleteTx(b.ctx, tx, c, "no-such-key", lc.Token), inboxdb.ErrLeaseLost)
			require.NoError(t, tx.Commit())
			leaseSame(t, before, leaseLookup(t, b, c, "k-wrong"))
		})

		t.Run("taken over", func(t *testing.T) {
			first := leaseAcquire(t, b, c, "k-taken", time.Hour, retryExpired)
			leaseExpire(t, b, c, "k-taken")
			lc := leaseAcquire(t, b, c, "k-taken", time.Hour, retryExpired)
			require.Equal(t, 2, lc.Attempt)
			require.True(t, lc.Interrupted)

			tx := b.begin(t)
			require.ErrorIs(t, b.store.CompleteTx(b.ctx, tx, c, "k-taken", first.Token), inboxdb.ErrLeaseLost,
				"the first worker lost the key")
			require.NoError(t, tx.Rollback())
			rec := leaseLookup(t, b, c, "k-taken")
			require.Equal(t, inboxdb.StatusProcessing, rec.Status)
			require.Equal(t, 2, rec.Attempts)

			leaseComplete(t, b, c, "k-taken", lc.Token)
			require.Equal(t, inboxdb.StatusDone, leaseLookup(t, b, c, "k-taken").Status)
		})
	})
}

func TestLeaseFail(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		const c = "c"
		// fail runs a fresh key's first attempt and fails it with text.
		var lastToken string
		fail := func(t *testing.T, key, text string, permanent bool) inboxdb.Record {
			t.Helper()
			lc := leaseAcquire(t, b, c, key, time.Hour, retryExpired)
			lastToken = lc.Token
			require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: key, Token: lc.Token}, text, permanent))
			rec := leaseLookup(t, b, c, key)
			require.Nil(t, rec.LeaseUntil, "the lease is released")
			require.NotNil(t, rec.ProcessedAt, "the attempt finished: retention ages the record from now")
			require.Equal(t, 1, rec.Attempts)
			return rec
		}

		t.Run("failed", func(t *testing.T) {
			rec := fail(t, "k", "provider answered 503", false)
			require.Equal(t, inboxdb.StatusFailed, rec.Status)
			require.Equal(t, "provider answered 503", rec.LastError)

			// A second Fail of the same attempt: it no longer owns the key.
			require.ErrorIs(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "k", Token: lastToken}, "again", false), inboxdb.ErrLeaseLost)
			require.Equal(t, "provider answered 503", leaseLookup(t, b, c, "k").LastError)

			// The next attempt fails in turn; its error replaces the old one.
			lc := leaseAcquire(t, b, c, "k", time.Hour, retryExpired)
			require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "k", Token: lc.Token}, "timeout", false))
			rec = leaseLookup(t, b, c, "k")
			require.Equal(t, 2, rec.Attempts)
			require.Equal(t, "timeout", rec.LastError)
		})

		// Stored error texts are bounded by pgtext.MaxErrorText: 2000 bytes,
		// as the outbox's.
		t.Run("long text", func(t *testing.T) {
			require.Equal(t, 2000, pgtext.MaxErrorText)
			rec := fail(t, "k-2000", strings.Repeat("y", 2000), false)
			require.Equal(t, strings.Repeat("y", 2000), rec.LastError, "2000 bytes are kept whole")

			rec = fail(t, "k-2001", strings.Repeat("y", 2001), false)
			require.Equal(t, strings.Repeat("y", 2000)+"...", rec.LastError, "one byte more is cut")

			rec = fail(t, "k-long", strings.Repeat("x", 10000), false)
			require.Equal(t, strings.Repeat("x", 2000)+"...", rec.LastError)

			// The cut falls on a character boundary.
			rec = fail(t, "k-cut", "x"+strings.Repeat("é", 3000), false)
			require.True(t, utf8.ValidString(rec.LastError))
			require.Equal(t, "x"+strings.Repeat("é", 999)+"...", rec.LastError)

			// Bad bytes are replaced before the cut, so the limit holds.
			rec = fail(t, "k-nul", strings.Repeat("\x00", 4000), false)
			require.True(t, utf8.ValidString(rec.LastError))
			require.LessOrEqual(t, len(rec.LastError), 2003)
		})

		t.Run("invalid text", func(t *testing.T) {
			rec := fail(t, "k-bad", "bad \xff\xfe utf-8, nul \x00 here", false)
			require.Equal(t, "bad \uFFFD\uFFFD utf-8, nul \uFFFD here", rec.LastError)

			rec = fail(t, "k-bad-long", strings.Repeat("\x00", 3000)+strings.Repeat("\xff", 3000), true)
			require.Equal(t, inboxdb.StatusParked, rec.Status)
			require.True(t, utf8.ValidString(rec.LastError))
			require.True(t, strings.HasPrefix(rec.LastError, "\uFFFD\uFFFD"))
			require.True(t, strings.HasSuffix(rec.LastError, "..."))
			require.LessOrEqual(t, len(rec.LastError), 2003, "truncated")
		})

		t.Run("permanent parks", func(t *testing.T) {
			rec := fail(t, "k-perm", "400 invalid phone number", true)
			require.Equal(t, inboxdb.StatusParked, rec.Status)
			require.Equal(t, "400 invalid phone number", rec.LastError)

			again := leaseClaim(t, b, c, "k-perm", time.Hour, retryExpired)
			require.Equal(t, inboxdb.LeaseParked, again.Outcome)
			require.False(t, again.ParkedNow)
			require.Equal(t, int64(1), again.Record.Duplicates)
		})

		t.Run("wrong token", func(t *testing.T) {
			lc := leaseAcquire(t, b, c, "k-wrong", time.Hour, retryExpired)
			before := leaseLookup(t, b, c, "k-wrong")
			for _, permanent := range []bool{false, true} {
				for _, token := range wrongTokens(lc.Token) {
					require.ErrorIs(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "k-wrong", Token: token}, "x", permanent), inboxdb.ErrLeaseLost)
				}
			}
			require.ErrorIs(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "no-such-key", Token: lc.Token}, "x", false), inboxdb.ErrLeaseLost)
			leaseSame(t, before, leaseLookup(t, b, c, "k-wrong"))
		})

		t.Run("taken over", func(t *testing.T) {
			first := leaseAcquire(t, b, c, "k-taken", time.Hour, retryExpired)
			leaseExpire(t, b, c, "k-taken")
			lc := leaseAcquire(t, b, c, "k-taken", time.Hour, retryExpired)
			require.Equal(t, 2, lc.Attempt)
			for _, permanent := range []bool{false, true} {
				require.ErrorIs(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "k-taken", Token: first.Token}, "late", permanent), inboxdb.ErrLeaseLost)
			}
			rec := leaseLookup(t, b, c, "k-taken")
			require.Equal(t, inboxdb.StatusProcessing, rec.Status, "the late worker does not disturb the new holder")
			require.Empty(t, rec.LastError)
			require.True(t, lc.LeaseUntil.Equal(*rec.LeaseUntil))
		})
	})
}

func TestLeaseParkedAndRelease(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		table := b.store.Table()
		// age sets first_seen_at to minutes ago.
		age := func(consumer, key string, minutes int) {
			q, args := " SET first_seen_at = now() - make_interval(mins => $3) WHERE consumer = $1 AND message_key = $2", []any{consumer, key, minutes}
			if b.mysql() {
				q, args = " SET first_seen_at = UTC_TIMESTAMP(6) - INTERVAL ? MINUTE WHERE consumer = ? AND message_key = ?", []any{minutes, consumer, key}
			}
			require.Equal(t, int64(1), b.exec(t, "UPDATE "+table+q, args...))
		}
		park := func(consumer, key string, minutes int) {
			lc := leaseAcquire(t, b, consumer, key, time.Hour, retryExpired)
			require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: consumer, Key: key, Token: lc.Token}, "parked "+key, true))
			age(consumer, key, minutes)
		}
		keys := func(recs []inboxdb.Record) []string {
			out := []string{}
			for _, r := range recs {
				require.Equal(t, inboxdb.StatusParked, r.Status)
				out = append(out, r.Consumer+"/"+r.Key)
			}
			return out
		}
		list := func(consumer string, limit int) []string {
			recs, err := b.store.ListParked(b.ctx, b.db, consumer, limit)
			require.NoError(t, err)
			return keys(recs)
		}

		park("c1", "p-b", 10)
		park("c1", "p-a", 30)
		park("c1", "p-c", 20)
		park("c2", "p-x", 25)
		// Older records of c1 in the other statuses are not listed.
		lc := leaseAcquire(t, b, "c1", "done", time.Hour, retryExpired)
		leaseComplete(t, b, "c1", "done", lc.Token)
		lc = leaseAcquire(t, b, "c1", "failed", time.Hour, retryExpired)
		require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: "c1", Key: "failed", Token: lc.Token}, "boom", false))
		leaseAcquire(t, b, "c1", "processing", time.Hour, retryExpired)
		for _, k := range []string{"done", "failed", "processing"} {
			age("c1", k, 60)
		}

		require.Equal(t, []string{"c1/p-a", "c1/p-c", "c1/p-b"}, list("c1", 0), "oldest first")
		require.Equal(t, []string{"c1/p-a", "c1/p-c", "c1/p-b"}, list("c1", -1), "limit <= 0 means the default")
		require.Equal(t, []string{"c1/p-a", "c1/p-c"}, list("c1", 2))
		require.Equal(t, []string{"c1/p-a", "c2/p-x", "c1/p-c", "c1/p-b"}, list("", 100), "all consumers")
		require.Equal(t, []string{"c1/p-a", "c2/p-x", "c1/p-c"}, list("", 3))
		require.Equal(t, []string{"c2/p-x"}, list("c2", 1))
		require.Empty(t, list("nobody", 10))

		recs, err := b.store.ListParked(b.ctx, b.db, "c1", 1)
		require.NoError(t, err)
		require.Len(t, recs, 1)
		require.Equal(t, "parked p-a", recs[0].LastError)
		require.Equal(t, 1, recs[0].Attempts)
		require.Nil(t, recs[0].LeaseUntil)

		// Release: parked -> failed, once.
		ok, err := b.store.Release(b.ctx, b.db, "c1", "p-c")
		require.NoError(t, err)
		require.True(t, ok)
		rec := leaseLookup(t, b, "c1", "p-c")
		require.Equal(t, inboxdb.StatusFailed, rec.Status)
		require.Equal(t, 1, rec.Attempts)
		ok, err = b.store.Release(b.ctx, b.db, "c1", "p-c")
		require.NoError(t, err)
		require.False(t, ok, "no longer parked")
		require.Equal(t, []string{"c1/p-a", "c1/p-b"}, list("c1", 0))

		// Not parked: nothing found, nothing changed.
		for _, k := range []string{"done", "failed", "processing", "no-such-key"} {
			var before *inboxdb.Record
			if r, err := b.store.Lookup(b.ctx, b.db, "c1", k); err == nil {
				before = &r
			}
			ok, err := b.store.Release(b.ctx, b.db, "c1", k)
			require.NoError(t, err)
			require.False(t, ok, k)
			if before != nil {
				leaseSame(t, *before, leaseLookup(t, b, "c1", k))
			}
		}
		ok, err = b.store.Release(b.ctx, b.db, "c2", "p-a")
		require.NoError(t, err)
		require.False(t, ok, "release is per consumer")
		require.Equal(t, inboxdb.StatusParked, leaseLookup(t, b, "c1", "p-a").Status)

		// The released key runs again; the others stay parked.
		lc = leaseAcquire(t, b, "c1", "p-c", time.Hour, retryExpired)
		require.Equal(t, 2, lc.Attempt)
		require.False(t, lc.Interrupted, "parked by a permanent error, not an interruption")
		require.Equal(t, inboxdb.LeaseParked, leaseClaim(t, b, "c1", "p-a", time.Hour, retryExpired).Outcome)

		// A key parked because its lease expired is released the same way.
		leaseAcquire(t, b, "c1", "p-expired", time.Hour, parkExpired)
		leaseExpire(t, b, "c1", "p-expired")
		require.True(t, leaseClaim(t, b, "c1", "p-expired", time.Hour, parkExpired).ParkedNow)
		ok, err = b.store.Release(b.ctx, b.db, "c1", "p-expired")
		require.NoError(t, err)
		require.True(t, ok)
		lc = leaseAcquire(t, b, "c1", "p-expired", time.Hour, parkExpired)
		require.Equal(t, 2, lc.Attempt)
		require.True(t, lc.Interrupted, "the parked attempt was cut off: the released one is told so")
		leaseComplete(t, b, "c1", "p-expired", lc.Token)
		require.Equal(t, inboxdb.StatusDone, leaseLookup(t, b, "c1", "p-expired").Status)
	})
}

// Purge deletes lease-mode records that are done or failed, never those
// processing (even with an expired lease) or parked.
func TestLeasePurgeKeepsProcessingAndParked(t *testing.T) {
	t.Parallel()
	eachEnginePlain(t, func(t *testing.T, b bundle) {
		const c = "c"
		lc := leaseAcquire(t, b, c, "done", time.Hour, retryExpired)
		leaseComplete(t, b, c, "done", lc.Token)
		lc = leaseAcquire(t, b, c, "failed", time.Hour, retryExpired)
		require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "failed", Token: lc.Token}, "boom", false))
		leaseAcquire(t, b, c, "live", time.Hour, retryExpired)
		leaseAcquire(t, b, c, "expired", time.Hour, retryExpired)
		leaseExpire(t, b, c, "expired")
		lc = leaseAcquire(t, b, c, "parked", time.Hour, retryExpired)
		require.NoError(t, b.store.Fail(b.ctx, b.db, inboxdb.Attempt{Consumer: c, Key: "parked", Token: lc.Token}, "permanent", true))
		leaseAcquire(t, b, c, "parked-expired", time.Hour, parkExpired)
		leaseExpire(t, b, c, "parked-expired")
		require.True(t, leaseClaim(t, b, c, "parked-expired", time.Hour, parkExpired).ParkedNow)
		require.Equal(t, int64(6), b.exec(t, "UPDATE "+b.store.Table()+b.sql(
			" SET first_seen_at = now() - interval '48 hours', processed_at = now() - interval '47 hours'",
			" SET first_seen_at = UTC_TIMESTAMP(6) - INTERVAL 48 HOUR, processed_at = UTC_TIMESTAMP(6) - INTERVAL 47 HOUR")))

		n, err := b.store.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: time.Hour, BatchSize: 1})
		require.NoError(t, err)
		require.Equal(t, int64(2), n, "done and failed")
		require.Equal(t, []string{"expired", "live", "parked", "parked-expired"},
			b.strings(t, "SELECT message_key FROM "+b.store.Table()+" ORDER BY 1"))

		// The survivors keep their state machine.
		require.Equal(t, inboxdb.LeaseBusy, leaseClaim(t, b, c, "live", time.Hour, retryExpired).Outcome)
		lc = leaseAcquire(t, b, c, "expired", time.Hour, retryExpired)
		require.Equal(t, 2, lc.Attempt)
		require.True(t, lc.Interrupted)
		require.Equal(t, inboxdb.LeaseParked, leaseClaim(t, b, c, "parked", time.Hour, retryExpired).Outcome)

		n, err = b.store.Purge(b.ctx, b.db, inboxdb.PurgeOptions{OlderThan: time.Nanosecond})
		require.NoError(t, err)
		require.Zero(t, n)
		require.Equal(t, int64(4), b.count(t, ""))
	})
}

func TestCountStatus(t *testing.T) {
	t.Parallel()
	eachEngine(t, func(t *testing.T, b bundle) {
		for i, status := range []string{"done", "done", "parked", "parked", "parked", "failed", "processing"} {
			consumer := "c1"
			if i%2 == 1 {
				consumer = "c2"
			}
			b.exec(t, "INSERT INTO "+b.tables.Inbox()+b.sql(" (consumer, message_key, status) VALUES ($1, $2, $3)",
				" (consumer, message_key, status, first_seen_at) VALUES (?, ?, ?, UTC_TIMESTAMP(6))"), consumer, fmt.Sprint("k", i), status)
		}
		for _, tc := range []struct {
			consumer string
			status   string
			want     int64
		}{
			{"", inboxdb.StatusParked, 3}, {"c1", inboxdb.StatusParked, 2}, {"c2", inboxdb.StatusParked, 1},
			{"", inboxdb.StatusDone, 2}, {"", inboxdb.StatusFailed, 1}, {"c1", inboxdb.StatusProcessing, 1}, {"c3", inboxdb.StatusParked, 0},
		} {
			n, err := b.store.CountStatus(b.ctx, b.db, tc.consumer, tc.status)
			require.NoError(t, err)
			require.Equal(t, tc.want, n, "%s/%s", tc.consumer, tc.status)
		}
	})
}

// wrongTokens are tokens that must never match a claim whose token is
// token: empty, malformed, another claim's.
func wrongTokens(token string) []string {
	other := "00000000-0000-4000-8000-000000000000"
	if token == other {
		other = "00000000-0000-4000-8000-000000000001"
	}
	return []string{"", "not-a-token", strings.ToUpper(token[:8]) + "x", other}
}
