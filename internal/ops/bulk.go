package ops

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
)

// The bulk protocol. An operator never acts on "whatever matches now": a
// count is shown (Target.Count: a Confirmation), the operator confirms it,
// and Run acts on what that count saw that still matches (the messages
// parked before its AsOf; the rows quarantined by its AsOf and not after
// its MaxID), first counting them again: another number than the one
// confirmed is refused, nothing done, with the count now to confirm
// instead (CountChangedError). The console's API and pages and the CLI
// run every bulk action so.

// Confirmation is a count an operator confirms, with its bounds: the
// confirmation token of a bulk action.
type Confirmation struct {
	// Count is the number of matches counted.
	Count int64
	// AsOf is the store's time of the count.
	AsOf time.Time
	// MaxID is, for outbox rows, the largest id counted (0 when none);
	// always 0 for parked messages.
	MaxID int64
}

// Result is what a bulk action did.
type Result struct {
	// Matched is the recount within the confirmation's bounds (the number
	// confirmed, when the action ran).
	Matched int64
	// Done counts the matches acted on; Skipped those left as they were
	// (not replayable, or changed by someone else meanwhile).
	Done, Skipped int64
}

// Target is the matches of one filter of one resource, as the protocol
// works on them (ParkedBulk, RowsBulk).
type Target interface {
	// Count counts the matches now.
	Count(ctx context.Context) (Confirmation, error)
	// Recount counts the matches within c's bounds: what is left of what c
	// counted.
	Recount(ctx context.Context, c Confirmation) (int64, error)
	// Act acts on the matches within c's bounds.
	Act(ctx context.Context, c Confirmation) (done, skipped int64, err error)
	// Now is the store's clock.
	Now(ctx context.Context) (time.Time, error)
	// Noun names one match and several ("message", "messages").
	Noun() (one, many string)
}

// Errors of Run.
var (
	// ErrBadConfirmation is returned (wrapped) for a confirmation that no
	// count gave: an as_of after the store's time now, a negative count,
	// a count of rows without its max_id.
	ErrBadConfirmation = errors.New("not the confirmation of a count")
	// ErrCountChanged is what a CountChangedError is.
	ErrCountChanged = errors.New("the count confirmed no longer holds")
)

// confirmationError is a confirmation no count gave: its message alone,
// matching ErrBadConfirmation.
type confirmationError struct{ msg string }

func (e *confirmationError) Error() string        { return e.msg }
func (e *confirmationError) Is(target error) bool { return target == ErrBadConfirmation }

func badConfirmation(format string, args ...any) error {
	return &confirmationError{msg: fmt.Sprintf(format, args...)}
}

// CountChangedError refuses a bulk action whose recount within the bounds
// of the count confirmed is not the number confirmed: nothing was done.
// Now is the count now, for a new confirmation.
type CountChangedError struct {
	Still, Expected int64
	Now             Confirmation
	one, many       string
}

func (e *CountChangedError) Error() string {
	var msg string
	if e.Still < e.Expected {
		msg = fmt.Sprintf("refused, nothing done: %d of the %s confirmed (expect) still match", e.Still, Plural(e.Expected, e.one, e.many))
	} else {
		msg = fmt.Sprintf("refused, nothing done: %s of those the count confirmed saw match, not the %d confirmed (expect)", Plural(e.Still, e.one, e.many), e.Expected)
	}
	verb := " match"
	if e.Now.Count == 1 {
		verb = " matches"
	}
	return msg + "; " + Plural(e.Now.Count, e.one, e.many) + verb + " now (count, as_of): look again and confirm the new count"
}

// Is makes a CountChangedError match ErrCountChanged.
func (e *CountChangedError) Is(target error) bool { return target == ErrCountChanged }

// StoppedError is the error of a bulk action that stopped part-way (a
// store's error, the context's end) after Done.
type StoppedError struct {
	Err  error
	Done int64
}

func (e *StoppedError) Error() string { return e.Err.Error() }
func (e *StoppedError) Unwrap() error { return e.Err }

// Check checks that c is what a count gives; rows says whether it counts
// outbox rows (which carry a max_id).
func (c Confirmation) Check(rows bool) error {
	switch {
	case c.Count < 0:
		return badConfirmation("expect is %d: a count is not negative", c.Count)
	case c.AsOf.IsZero():
		return badConfirmation("as_of is required: the as_of of the count you confirmed")
	case !rows && c.MaxID != 0:
		return badConfirmation("max_id is a bound of outbox rows, not of parked messages (their count's as_of bounds them)")
	case rows && c.MaxID < 0:
		return badConfirmation("max_id is %d: the max_id of the count (a row id, 0 when it counted none)", c.MaxID)
	case rows && c.MaxID == 0 && c.Count > 0:
		return badConfirmation("max_id is 0 and expect is %d: a count of rows has the largest id it counted (max_id)", c.Count)
	}
	return nil
}

// Run acts on t's matches within c, the count the operator confirmed: it
// refuses a c from the future, counts again within c's bounds and refuses
// another number than c.Count (a *CountChangedError with the count now),
// then acts. An action that stopped part-way returns a *StoppedError with
// what it did.
func Run(ctx context.Context, t Target, c Confirmation) (Result, error) {
	now, err := t.Now(ctx)
	if err != nil {
		return Result{}, err
	}
	if c.AsOf.After(now) {
		return Result{}, badConfirmation("as_of is %s, after the store's time %s, now: give the as_of of the count you confirmed",
			FmtTime(c.AsOf), FmtTime(now))
	}
	var res Result
	if res.Matched, err = t.Recount(ctx, c); err != nil {
		return Result{}, err
	}
	if res.Matched != c.Count {
		fresh, err := t.Count(ctx)
		if err != nil {
			return res, err
		}
		one, many := t.Noun()
		return res, &CountChangedError{Still: res.Matched, Expected: c.Count, Now: fresh, one: one, many: many}
	}
	if res.Matched == 0 {
		return res, nil // nothing confirmed, nothing to do
	}
	res.Done, res.Skipped, err = t.Act(ctx, c)
	if err != nil {
		return res, &StoppedError{Err: err, Done: res.Done}
	}
	return res, nil
}

// FmtTime is a bound as the tools show it and take it back: RFC 3339 with
// nanoseconds, UTC; "" for the zero time.
func FmtTime(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(time.RFC3339Nano)
}

// Plural is n with its noun: "1 message", "2 messages".
func Plural(n int64, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return strconv.FormatInt(n, 10) + " " + many
}

// Token is c as one word, for a command line: COUNT@AS_OF, and /MAX_ID
// for rows.
func (c Confirmation) Token() string {
	s := strconv.FormatInt(c.Count, 10) + "@" + FmtTime(c.AsOf)
	if c.MaxID != 0 {
		s += "/" + strconv.FormatInt(c.MaxID, 10)
	}
	return s
}

// ParseToken reads a Token.
func ParseToken(s string) (Confirmation, error) {
	bad := badConfirmation("%q: want COUNT@AS_OF[/MAX_ID], as the count printed it", s)
	n, rest, ok := strings.Cut(s, "@")
	if !ok {
		return Confirmation{}, bad
	}
	var c Confirmation
	var err error
	if c.Count, err = strconv.ParseInt(n, 10, 64); err != nil {
		return Confirmation{}, bad
	}
	at, id, hasID := strings.Cut(rest, "/")
	if c.AsOf, err = time.Parse(time.RFC3339Nano, at); err != nil {
		return Confirmation{}, bad
	}
	if hasID {
		if c.MaxID, err = strconv.ParseInt(id, 10, 64); err != nil {
			return Confirmation{}, bad
		}
	}
	return c, nil
}

// Verbs of the bulk actions.
const (
	VerbReplay  = "replay"
	VerbDiscard = "discard"
	VerbRequeue = "requeue"
)

// ParkedBulk is the parked messages a filter matches, for a bulk replay
// (Topic) or discard (Forget).
type ParkedBulk struct {
	Store  Store
	Filter inbox.ParkedFilter
	Verb   string // VerbReplay or VerbDiscard
	Topic  string
	Forget bool
}

// Noun is "message", "messages".
func (ParkedBulk) Noun() (string, string) { return "message", "messages" }

// Now is the store's clock.
func (b ParkedBulk) Now(ctx context.Context) (time.Time, error) { return b.Store.Now(ctx) }

// Count counts the matches parked before now.
func (b ParkedBulk) Count(ctx context.Context) (Confirmation, error) {
	asOf, err := b.Store.Now(ctx)
	if err != nil {
		return Confirmation{}, err
	}
	n, err := b.Recount(ctx, Confirmation{AsOf: asOf})
	return Confirmation{Count: n, AsOf: asOf}, err
}

// Recount counts the matches parked before c.AsOf.
func (b ParkedBulk) Recount(ctx context.Context, c Confirmation) (int64, error) {
	f, none := BoundParked(b.Filter, c.AsOf)
	if none {
		return 0, nil
	}
	return b.Store.CountParked(ctx, f)
}

// Act replays or discards the matches parked before c.AsOf. The operator
// confirmed the filter with its count: an empty one means every message
// (All).
func (b ParkedBulk) Act(ctx context.Context, c Confirmation) (done, skipped int64, err error) {
	f, none := BoundParked(b.Filter, c.AsOf)
	if none {
		return 0, 0, nil
	}
	if b.Verb == VerbReplay {
		rep, err := b.Store.ReplayParkedMatching(ctx, f, inbox.ReplayOptions{Topic: b.Topic, All: true})
		return rep.Replayed, rep.Skipped, err
	}
	n, err := b.Store.DiscardParkedMatching(ctx, f, inbox.DiscardOptions{Forget: b.Forget, All: true})
	return n, 0, err
}

// BoundParked is f selecting the messages parked before asOf only; none
// reports that it selects nothing (Since is not before asOf).
func BoundParked(f inbox.ParkedFilter, asOf time.Time) (_ inbox.ParkedFilter, none bool) {
	if f.Before.IsZero() || f.Before.After(asOf) {
		f.Before = asOf
	}
	return f, !f.Since.IsZero() && !f.Since.Before(f.Before)
}
