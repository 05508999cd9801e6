package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"

	"github.com/exactlyonce/watermill-exactlyonce/internal/ops"
)

// The flags the dead-letter commands share: parked messages (parked ...)
// and quarantined outbox rows (outbox rows, requeue, discard) are found by
// the same kinds of criteria.

// searchFlags are the criteria common to both kinds.
type searchFlags struct {
	uuid   string
	reason string
	since  string
	until  string
	meta   []string
	limit  int
	yes    bool
	// confirm is a count's confirmation (ops.Confirmation.Token), as the
	// count without --yes printed it.
	confirm string
}

func (f *searchFlags) register(cmd *cobra.Command, bulk bool) {
	fl := cmd.Flags()
	fl.StringVar(&f.uuid, "uuid", "", "the message's UUID")
	fl.StringVar(&f.reason, "reason", "", "text in the reason (last error), case-insensitive")
	fl.StringVar(&f.since, "since", "", "parked/quarantined at or after: RFC 3339, or a duration ago (2h, 3d)")
	fl.StringVar(&f.until, "until", "", "parked/quarantined before: RFC 3339, or a duration ago")
	fl.StringArrayVar(&f.meta, "meta", nil, "a metadata field, key=value (repeatable; every one must match), e.g. --meta order_id=42")
	if bulk {
		fl.BoolVar(&f.yes, "yes", false, "act on every match (without it: print how many match and what would happen)")
		fl.StringVar(&f.confirm, "confirm", "", "act on the matches the count printed this confirmation for (COUNT@AS_OF[/MAX_ID]), only if they are still that many; else exit 4, nothing done")
	} else {
		fl.IntVar(&f.limit, "limit", 50, "list at most this many")
	}
}

// any reports whether a criterion was given (a bulk action needs one).
func (f *searchFlags) any() bool {
	return f.uuid != "" || f.reason != "" || f.since != "" || f.until != "" || len(f.meta) > 0
}

// confirmation is the target and the count a bulk action acts on:
// --confirm's, or the count now (acted on with --yes); act is false
// without either (print the count). build makes the target of the
// criteria, their durations (--since 2h) taken back from asOf, the count's
// as_of: the one --confirm names, so that the action selects what its
// count did (not a window that slid since), or the store's time now (now),
// the as_of of the count made here. rows says whether target counts outbox
// rows (a confirmation with a max_id; build sets the filter's AsOf to
// asOf, at which their count counts).
func (f *searchFlags) confirmation(ctx context.Context, now func(context.Context) (time.Time, error),
	build func(asOf time.Time) (ops.Target, error), rows bool) (target ops.Target, c ops.Confirmation, act bool, err error) {
	if f.confirm != "" {
		if f.yes {
			return nil, c, false, usageErr("--yes or --confirm, not both: --confirm acts on what its count saw, --yes on what matches now")
		}
		if c, err = ops.ParseToken(f.confirm); err == nil {
			err = c.Check(rows)
		}
		if err != nil {
			return nil, c, false, usageErr("--confirm: %v", err)
		}
		target, err = build(c.AsOf)
		return target, c, true, err
	}
	target, c, err = count(ctx, now, build, rows)
	return target, c, f.yes, err
}

// count counts the matches of the target build makes at the store's time
// now, its durations taken back from that time (see confirmation).
func count(ctx context.Context, now func(context.Context) (time.Time, error),
	build func(asOf time.Time) (ops.Target, error), rows bool) (target ops.Target, c ops.Confirmation, err error) {
	asOf, err := now(ctx)
	if err != nil {
		return nil, c, err
	}
	if target, err = build(asOf); err != nil {
		return nil, c, err
	}
	if rows {
		c, err = target.Count(ctx) // at the filter's AsOf
	} else {
		c.AsOf = asOf
		c.Count, err = target.Recount(ctx, c)
	}
	return target, c, err
}

// recount gives the refusal of ops.Run (a *ops.CountChangedError) the
// count now of the criteria with their durations taken back from now, the
// as_of of its confirmation: ops.Run counted the target it was given, whose
// durations were taken back from the refused confirmation's as_of. Any
// other err is returned as it is.
func recount(ctx context.Context, err error, now func(context.Context) (time.Time, error),
	build func(asOf time.Time) (ops.Target, error), rows bool) error {
	var ce *ops.CountChangedError
	if errors.As(err, &ce) {
		if _, c, cerr := count(ctx, now, build, rows); cerr == nil {
			ce.Now = c
		}
	}
	return err
}

// bulkErr is err of ops.Run with its exit status: a changed count is
// exit 4 (nothing done), with the confirmation of the count now.
func bulkErr(err error) error {
	var ce *ops.CountChangedError
	switch {
	case errors.As(err, &ce):
		return &exitError{code: exitChanged, err: fmt.Errorf("%w; to act on those: --confirm %s", err, ce.Now.Token())}
	case errors.Is(err, ops.ErrBadConfirmation):
		return usageErr("--confirm: %v", err)
	}
	return err
}

// metadata parses --meta.
func (f *searchFlags) metadata() (map[string]string, error) {
	if len(f.meta) == 0 {
		return nil, nil
	}
	out := make(map[string]string, len(f.meta))
	for _, kv := range f.meta {
		k, v, ok := strings.Cut(kv, "=")
		if !ok || k == "" {
			return nil, usageErr("--meta %q: want key=value", kv)
		}
		out[k] = v
	}
	return out, nil
}

// window parses --since and --until against now.
func (f *searchFlags) window(now time.Time) (since, until time.Time, err error) {
	if since, err = parseWhen("--since", f.since, now); err != nil {
		return
	}
	until, err = parseWhen("--until", f.until, now)
	return
}

// parseWhen reads a time: RFC 3339, or a duration before now (with d for
// days).
func parseWhen(flag, s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, nil
	}
	if d, err := parseAge(s); err == nil && d >= 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, usageErr("%s %q: want an RFC 3339 time (2026-11-26T10:00:00Z) or a duration ago (90m, 2h, 3d)", flag, s)
}

// prettyPayload is a payload for humans: indented when it is JSON, the text
// when it is UTF-8, else hex.
func prettyPayload(p []byte) string {
	var buf bytes.Buffer
	if json.Valid(p) && json.Indent(&buf, p, "", "  ") == nil {
		return buf.String()
	}
	if utf8.Valid(p) {
		return string(p)
	}
	return fmt.Sprintf("(%d bytes, not text) %x", len(p), p)
}

// metadataLines prints metadata sorted by key, one per line.
func metadataLines(m map[string]string) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "  %s: %s\n", k, m[k])
	}
	return b.String()
}

// payloadJSON is a payload in a JSON document: the JSON value itself when
// it is JSON, else a string (UTF-8) or base64 bytes.
type payloadJSON struct {
	JSON   json.RawMessage `json:"json,omitempty"`
	Text   *string         `json:"text,omitempty"`
	Base64 []byte          `json:"base64,omitempty"`
}

func payloadDoc(p []byte) *payloadJSON {
	switch {
	case p == nil:
		return nil
	case json.Valid(p):
		return &payloadJSON{JSON: p}
	case utf8.Valid(p):
		s := string(p)
		return &payloadJSON{Text: &s}
	}
	return &payloadJSON{Base64: p}
}

// exactArgs wants n arguments, named what in the usage error.
func exactArgs(n int, what string) cobra.PositionalArgs {
	return func(_ *cobra.Command, args []string) error {
		if len(args) != n {
			return usageErr("want %s (%d argument(s)), got %d", what, n, len(args))
		}
		return nil
	}
}

// maxArgs wants at most n arguments, named what in the usage error.
func maxArgs(n int, what string) cobra.PositionalArgs {
	return func(_ *cobra.Command, args []string) error {
		if len(args) > n {
			return usageErr("want at most %s (%d argument(s)), got %d", what, n, len(args))
		}
		return nil
	}
}
