package exactlyonce

// The middleware's protocols as pure functions, tested without a database:
// group commit's policy (nextStep, failedFate, followerFate), lease
// completion's classifier (classifyLease) and the delivery's outcome, set
// once.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
)

func pgErr(code string) error { return &pgconn.PgError{Code: code, Message: "sqlstate " + code} }

// testGroup is a batch of n jobs, keys k0, k1...
func testGroup(n int) []*job {
	group := make([]*job, n)
	for i := range group {
		key := fmt.Sprintf("k%d", i)
		group[i] = &job{d: &delivery{msg: message.NewMessage(key, nil), ctx: context.Background(), consumer: "c", key: key}}
	}
	return group
}

// claimsOf is an attempt's claims from one letter per job: c claimed, d a
// duplicate, p a parked key, e its own claim failed (ErrNotDone).
func claimsOf(s string) ([]inboxdb.ClaimResult, []error) {
	claims := make([]inboxdb.ClaimResult, len(s))
	cerrs := make([]error, len(s))
	for i, c := range s {
		switch c {
		case 'c':
			claims[i].Claimed = true
		case 'd':
			claims[i].Existing = inboxdb.Record{Status: inboxdb.StatusDone, FirstSeenAt: time.Unix(1, 0)}
		case 'p':
			claims[i].Existing = inboxdb.Record{Status: inboxdb.StatusParked, FirstSeenAt: time.Unix(2, 0)}
		case 'e':
			cerrs[i] = fmt.Errorf("refused: %w", inboxdb.ErrNotDone)
		}
	}
	return claims, cerrs
}

// TestNextStep: group commit's policy, from what an attempt came to (the
// claims, where it failed, the reruns so far) to the batch's next step and
// the outcomes it settles.
func TestNextStep(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	cases := []struct {
		name   string
		claims string // see claimsOf
		at     failedAt
		job    int
		err    error
		reruns int

		kind     stepKind
		fault    int
		outcomes []Outcome // "" for a job that runs again
		wait     []bool    // nil: none waits
		park     bool      // the fault's key is parked
		is       error     // the fault's (or, settled, every Nacked job's) error wraps it
	}{
		{name: "committed", claims: "ccc", kind: stepSettled, outcomes: []Outcome{Processed, Processed, Processed}},
		{name: "committed with a duplicate, a parked key and a failed claim", claims: "dpec", kind: stepSettled,
			outcomes: []Outcome{Duplicate, Parked, Nacked, Processed}, wait: []bool{false, false, true, false}, is: ErrClaimFailed},
		{name: "handler fails", claims: "ccc", at: atHandler, job: 1, err: boom,
			kind: stepWithout, fault: 1, outcomes: []Outcome{"", Nacked, ""}, is: boom},
		{name: "handler fails permanently: parked", claims: "cc", at: atHandler, job: 0, err: Permanent(boom),
			kind: stepWithout, fault: 0, outcomes: []Outcome{Nacked, ""}, park: true, is: boom},
		{name: "output refused: after NackDelay", claims: "cc", at: atHandler, job: 1, err: fmt.Errorf("x: %w", ErrNoDestination),
			kind: stepWithout, fault: 1, outcomes: []Outcome{"", Nacked}, wait: []bool{false, true}, is: ErrNoDestination},
		{name: "nested middleware: after NackDelay", claims: "cc", at: atHandler, job: 0, err: fmt.Errorf("x: %w", ErrNestedMiddleware),
			kind: stepWithout, fault: 0, outcomes: []Outcome{Nacked, ""}, wait: []bool{true, false}, is: ErrNestedMiddleware},
		{name: "conflict: the batch runs again with it", claims: "cc", at: atHandler, job: 1, err: pgErr("40P01"),
			kind: stepRetry, fault: 1, outcomes: []Outcome{"", ""}},
		{name: "conflict after the last rerun: nacked", claims: "c", at: atHandler, job: 0, err: pgErr("40001"), reruns: maxBatchReruns,
			kind: stepWithout, fault: 0, outcomes: []Outcome{Nacked}},
		{name: "aborted transaction after another handler: split", claims: "cc", at: atHandler, job: 1, err: pgErr("25P02"),
			kind: stepSplit, outcomes: []Outcome{"", ""}},
		{name: "aborted transaction at the first handler: its own", claims: "cc", at: atHandler, job: 0, err: pgErr("25P02"),
			kind: stepWithout, fault: 0, outcomes: []Outcome{Nacked, ""}},
		{name: "aborted transaction at the first handler that ran (after a duplicate)", claims: "dc", at: atHandler, job: 1, err: pgErr("25P02"),
			kind: stepWithout, fault: 1, outcomes: []Outcome{"", Nacked}},
		{name: "deferred statement fails", claims: "cc", at: atDeferred, job: 1, err: pgErr("23505"),
			kind: stepWithout, fault: 1, outcomes: []Outcome{"", Nacked}},
		{name: "deferred statement in an aborted transaction: split", claims: "cc", at: atDeferred, job: 1, err: pgErr("25P02"),
			kind: stepSplit, outcomes: []Outcome{"", ""}},
		{name: "deferred statement in an aborted transaction, alone", claims: "dc", at: atDeferred, job: 1, err: pgErr("25P02"),
			kind: stepWithout, fault: 1, outcomes: []Outcome{"", Nacked}},
		{name: "commit refused: split", claims: "cc", at: atCommit, err: pgErr("23505"), kind: stepSplit, outcomes: []Outcome{"", ""}},
		{name: "commit answered ROLLBACK: split", claims: "cc", at: atCommit, err: pgx.ErrTxCommitRollback, kind: stepSplit, outcomes: []Outcome{"", ""}},
		{name: "commit refused, alone", claims: "dc", at: atCommit, err: pgErr("23505"),
			kind: stepSettled, outcomes: []Outcome{Duplicate, Nacked}},
		{name: "commit outcome unknown: every message that ran nacked", claims: "cdc", at: atCommit, err: io.ErrUnexpectedEOF,
			kind: stepSettled, outcomes: []Outcome{Nacked, Duplicate, Nacked}, is: io.ErrUnexpectedEOF},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			group := testGroup(len(tc.claims))
			a := attempt{at: tc.at, job: tc.job, err: tc.err}
			a.claims, a.cerrs = claimsOf(tc.claims)
			st := nextStep(a, group, tc.reruns)
			require.Equal(t, tc.kind, st.kind)
			if tc.kind == stepRetry || tc.kind == stepWithout {
				require.Equal(t, tc.fault, st.fault)
			}
			for i, want := range tc.outcomes {
				var f fate
				if st.fates != nil {
					f = st.fates[i]
				}
				require.Equal(t, want, f.outcome, "job %d", i)
				require.Equal(t, tc.wait != nil && tc.wait[i], f.wait, "job %d waits", i)
				if want == Nacked {
					require.Error(t, f.err, "job %d", i)
					if tc.is != nil {
						require.ErrorIs(t, f.err, tc.is, "job %d", i)
					}
				}
				if tc.kind == stepWithout && i == tc.fault {
					require.Equal(t, tc.park, f.park, "the fault is parked")
				} else {
					require.False(t, f.park, "job %d", i)
				}
				if tc.claims[i] == 'd' || tc.claims[i] == 'p' {
					if want != "" {
						require.False(t, f.firstSeen.IsZero(), "job %d: when its key was first seen", i)
					}
				}
			}
		})
	}
}

// TestNextStepErrors: a conflict that nacks its message
// after the last rerun is logged by the middleware (at info level) and
// marked for RouterLogger; the commit errors say which they are.
func TestNextStepErrors(t *testing.T) {
	t.Parallel()
	group := testGroup(1)
	a := attempt{at: atHandler, job: 0, err: pgErr("40P01")}
	a.claims, a.cerrs = claimsOf("c")
	st := nextStep(a, group, maxBatchReruns)
	require.True(t, st.fates[0].conflict)
	require.True(t, wasReported(st.fates[0].err), "a conflict's nack is reported")

	a = attempt{at: atCommit, err: pgErr("23505")}
	a.claims, a.cerrs = claimsOf("c")
	st = nextStep(a, group, 0)
	require.ErrorContains(t, st.fates[0].err, `commit of "k0" for "c" refused by the server, nothing committed`)

	group = testGroup(2)
	a = attempt{at: atCommit, err: io.EOF}
	a.claims, a.cerrs = claimsOf("cc")
	st = nextStep(a, group, 0)
	require.ErrorContains(t, st.fates[1].err, `commit of a batch of 2 (with "k1" for "c") failed, its outcome is unknown`)

	a = attempt{claimErr: io.EOF, claimSentinel: ErrDBUnavailable}
	st = nextStep(a, group, 0)
	require.Equal(t, stepSettled, st.kind)
	for i, f := range st.fates {
		require.Equal(t, Nacked, f.outcome)
		require.True(t, f.wait, "job %d waits NackDelay", i)
		require.ErrorIs(t, f.err, ErrDBUnavailable)
		require.ErrorIs(t, f.err, io.EOF)
		require.True(t, wasReported(f.err), "logged as an episode")
		require.ErrorContains(t, f.err, fmt.Sprintf(`exactlyonce: claim of "k%d" for "c": database unavailable: EOF`, i))
	}
}

// TestFollowerFate: a copy of a key that followed its first delivery in a
// batch ends as that one did: a duplicate of a processed key, parked with a
// parked one, nacked with a nacked one.
func TestFollowerFate(t *testing.T) {
	t.Parallel()
	seen := time.Unix(3, 0)
	boom := errors.New("boom")
	cases := []struct {
		leader Outcome
		err    error
		want   Outcome
	}{
		{Processed, nil, Duplicate},
		{Duplicate, nil, Duplicate},
		{Parked, boom, Parked},
		{Nacked, boom, Nacked},
	}
	for _, tc := range cases {
		leader := &delivery{ev: Event{Outcome: tc.leader, Err: tc.err, FirstSeenAt: seen}}
		f := followerFate(&delivery{consumer: "c", key: "k"}, leader)
		require.Equal(t, tc.want, f.outcome, "after %s", tc.leader)
		switch tc.want {
		case Duplicate:
			require.Equal(t, seen, f.firstSeen)
		case Nacked:
			require.ErrorIs(t, f.err, boom)
		default:
			require.NoError(t, f.err)
		}
	}
}

// TestClassifyLease: how a lease-mode attempt ends, from the stage it
// stopped at and that stage's error.
func TestClassifyLease(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	lost := fmt.Errorf("x: %w", leasestore.ErrLeaseLost)
	cases := []struct {
		name  string
		stage leaseStage
		err   error
		want  leaseEnd
	}{
		{"committed", stageNone, nil, leaseDone},
		{"handler error", stageHandler, boom, leaseFailed},
		{"handler panic", stageHandler, fmt.Errorf("exactlyonce: handler panicked: %w", boom), leaseFailed},
		{"handler conflict", stageHandler, pgErr("40001"), leaseFailed},
		{"handler Permanent", stageHandler, Permanent(boom), leasePark},
		{"store-only misuse", stageMisuse, boom, leasePark},
		{"begin failed", stageBegin, io.EOF, leaseAfterLease},
		{"outputs refused", stageOutputs, fmt.Errorf("x: %w", errOutput), leasePark},
		{"outputs without destination", stageOutputs, fmt.Errorf("x: %w", ErrNoDestination), leasePark},
		{"write: data error", stageWrite, pgErr("22021"), leasePark},
		{"write: output refused", stageWrite, fmt.Errorf("x: %w", errOutput), leasePark},
		{"write: connection lost", stageWrite, io.ErrUnexpectedEOF, leaseAfterLease},
		{"write: timeout", stageWrite, pgErr("57014"), leaseAfterLease},
		{"complete: lease lost", stageComplete, lost, leaseLost},
		{"complete: serialization failure, still owned", stageComplete, pgErr("40001"), leaseAfterLease},
		{"complete: serialization failure, found lost", stageComplete, fmt.Errorf("%w (%w)", leasestore.ErrLeaseLost, pgErr("40001")), leaseLost},
		{"complete: constraint", stageComplete, pgErr("23505"), leasePark},
		{"complete: aborted transaction", stageComplete, pgErr("25P02"), leasePark},
		{"complete: store unreachable", stageComplete, io.EOF, leaseAfterLease},
		{"commit: deferred constraint", stageCommit, pgErr("23505"), leasePark},
		{"commit: answered ROLLBACK", stageCommit, pgx.ErrTxCommitRollback, leaseAfterLease},
		{"commit: serialization failure", stageCommit, pgErr("40001"), leaseAfterLease},
		{"commit: outcome unknown", stageCommit, io.ErrUnexpectedEOF, leaseAfterLease},
		{"park: lease lost", stagePark, lost, leaseLost},
		{"park: failed", stagePark, io.EOF, leaseAfterLease},
	}
	for _, tc := range cases {
		require.Equal(t, tc.want, classifyLease(tc.stage, tc.err), tc.name)
	}
}

// TestAfterLeaseError: the errors of a completion with an unknown outcome
// say what failed and what happens next.
func TestAfterLeaseError(t *testing.T) {
	t.Parallel()
	d := &delivery{consumer: "c", key: "k"}
	boom := errors.New("boom")
	err := afterLeaseError(d, leaseResult{stage: stageBegin, err: io.EOF, handlerErr: boom})
	require.ErrorIs(t, err, ErrDBUnavailable)
	require.ErrorIs(t, err, boom)
	require.ErrorContains(t, err, `exactlyonce: "k" for "c": completion failed after the handler ran: `)
	err = afterLeaseError(d, leaseResult{stage: stageCommit, err: pgx.ErrTxCommitRollback})
	require.ErrorContains(t, err, `completion of "k" for "c" refused by the server, nothing committed (the server answered ROLLBACK`)
	err = afterLeaseError(d, leaseResult{stage: stageCommit, err: io.EOF})
	require.ErrorContains(t, err, `completion of "k" for "c" failed, its outcome is unknown`)
	// A hot standby refuses the completion's BEGIN READ WRITE with 0A000:
	// read-only, not unreachable.
	standby := &pgconn.PgError{Code: "0A000", Message: "cannot set transaction read-write mode during recovery"}
	err = afterLeaseError(d, leaseResult{stage: stageBegin, err: standby})
	require.ErrorIs(t, err, ErrDBReadOnly)
	require.NotErrorIs(t, err, ErrDBUnavailable)
	err = afterLeaseError(d, leaseResult{stage: stagePark, err: io.EOF, cause: boom})
	require.ErrorIs(t, err, boom)
	require.ErrorContains(t, err, "boom (and parking failed: EOF)")
}

// TestDeliverySettlesOnce: a delivery's outcome is set once; setting it
// again, or never, is a bug of the middleware, which panics in tests.
func TestDeliverySettlesOnce(t *testing.T) {
	t.Parallel()
	boom := errors.New("boom")
	newDelivery := func() *delivery { return &delivery{msg: message.NewMessage("u", nil)} }

	d := newDelivery()
	d.nack(boom)
	require.Panics(t, func() { d.settle(Processed, nil) }, "a second outcome")
	require.Equal(t, Nacked, d.ev.Outcome, "the first is kept")
	out, err := d.result()
	require.Nil(t, out)
	require.ErrorIs(t, err, boom)
	require.False(t, d.wait)

	require.Panics(t, func() { _, _ = newDelivery().result() }, "no outcome")

	d = newDelivery()
	d.nackLater(boom)
	require.True(t, d.wait, "returned after NackDelay")

	d = newDelivery()
	d.settle(Parked, boom)
	out, err = d.result()
	require.Nil(t, out)
	require.NoError(t, err, "parked: acked; the reason is the event's")
	require.ErrorIs(t, d.ev.Err, boom)

	d = newDelivery()
	d.out = []*message.Message{message.NewMessage("o", nil)}
	d.settle(FailOpen, nil)
	out, err = d.result()
	require.NoError(t, err)
	require.Len(t, out, 1, "fail-open: the router publishes the handler's messages")
}
