package main

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/spf13/cobra"

	"github.com/exactlyonce/watermill-exactlyonce/internal/ops"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// rowFlags select outbox rows that failed: quarantined (the default),
// failing, or both.
type rowFlags struct {
	searchFlags
	topic       string
	orderingKey string
	state       string
	after       int64
}

func (f *rowFlags) register(cmd *cobra.Command, bulk bool) {
	f.searchFlags.register(cmd, bulk)
	cmd.Flags().StringVar(&f.topic, "topic", "", "the row's topic")
	cmd.Flags().StringVar(&f.orderingKey, "ordering-key", "", "the rows of this ordering key (the failed rows that block it)")
	cmd.Flags().StringVar(&f.state, "state", string(outbox.StateQuarantined), "quarantined, failing (retrying, not quarantined) or all")
	if !bulk {
		cmd.Flags().Int64Var(&f.after, "after", 0, "list the rows after this id (the next page)")
	}
}

func (f *rowFlags) filter(now time.Time) (outbox.RowFilter, error) {
	meta, err := f.metadata()
	if err != nil {
		return outbox.RowFilter{}, err
	}
	since, until, err := f.window(now)
	if err != nil {
		return outbox.RowFilter{}, err
	}
	switch outbox.RowState(f.state) {
	case outbox.StateQuarantined, outbox.StateFailing, outbox.StateAll:
	default:
		return outbox.RowFilter{}, usageErr("--state %q: one of quarantined, failing, all", f.state)
	}
	return outbox.RowFilter{State: outbox.RowState(f.state), Topic: f.topic, UUID: f.uuid, Reason: f.reason,
		QuarantinedSince: since, QuarantinedBefore: until, Metadata: meta, OrderingKey: f.orderingKey}, nil
}

func (f *rowFlags) anyCriterion() bool { return f.any() || f.topic != "" || f.orderingKey != "" }

// rowCmds are outbox rows, show, requeue and discard.
func (a *app) rowCmds() []*cobra.Command {
	var list rowFlags
	rows := &cobra.Command{
		Use:   "rows",
		Short: "Find quarantined (or failing) rows by topic, UUID, reason, time, ordering key or a metadata field",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			f, err := list.filter(time.Now())
			if err != nil {
				return err
			}
			return a.withOutbox(cmd, func(ctx context.Context, db sqlschema.DB) error {
				return a.outboxRows(ctx, db, f, outbox.Page{After: afterID(list.after), Limit: list.limit})
			})
		},
	}
	list.register(rows, false)

	var full bool
	show := &cobra.Command{
		Use:   "show ID",
		Short: "One outbox row: its message (the payload's first 64 KiB, pretty-printed when JSON), metadata, failures and last error",
		Args:  exactArgs(1, "the row's id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			id, err := rowID(args[0])
			if err != nil {
				return err
			}
			return a.withOutbox(cmd, func(ctx context.Context, db sqlschema.DB) error {
				return a.outboxShow(ctx, db, id, full)
			})
		},
	}
	show.Flags().BoolVar(&full, "full-payload", false, fullPayloadUsage)

	var rq, dc rowFlags
	var rqIf, dcIf ifFlags
	requeue := &cobra.Command{
		Use:   "requeue [ID]",
		Short: "Send quarantined rows again now: one by id, or every row matching the criteria (--yes)",
		Args:  maxArgs(1, "the row's id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.rowAction(cmd, args, &rq, rqIf, "requeue")
		},
	}
	rq.register(requeue, true)
	rqIf.register(requeue, "exactlyonce outbox show", false)
	discard := &cobra.Command{
		Use:   "discard [ID]",
		Short: "Delete quarantined rows (their messages are never sent): one by id, or every row matching the criteria (--yes)",
		Args:  maxArgs(1, "the row's id"),
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.rowAction(cmd, args, &dc, dcIf, "discard")
		},
	}
	dc.register(discard, true)
	dcIf.register(discard, "exactlyonce outbox show", false)
	return []*cobra.Command{rows, show, requeue, discard}
}

func rowID(s string) (int64, error) {
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil || id < 1 {
		return 0, usageErr("%q is not a row id (a positive integer, as outbox rows prints it)", s)
	}
	return id, nil
}

type rowJSON struct {
	ID                int64             `json:"id"`
	Topic             string            `json:"topic"`
	UUID              string            `json:"uuid"`
	State             string            `json:"state"`
	CreatedAt         *string           `json:"created_at"`
	QuarantinedAt     *string           `json:"quarantined_at"`
	NextAttemptAt     *string           `json:"next_attempt_at"`
	Failures          int               `json:"failures"`
	PermanentFailures int               `json:"permanent_failures"`
	LastError         string            `json:"last_error"`
	Metadata          map[string]string `json:"metadata"`
	PayloadBytes      int               `json:"payload_bytes"`
	Payload           *payloadJSON      `json:"payload,omitempty"`
	// PayloadTruncated, with the payload, reports whether it holds only
	// the payload's first bytes (show without --full-payload).
	PayloadTruncated *bool `json:"payload_truncated,omitempty"`
	// OrderingKey is "" for a row without one; Waiting counts the rows of
	// its key behind a failed row (outbox.Row.Waiting).
	OrderingKey string `json:"ordering_key"`
	Waiting     int64  `json:"waiting"`
	// Version is the row's (outbox.Row.Version): requeue and discard
	// --if-version take it.
	Version string `json:"version"`
}

func rowDoc(r outbox.Row, withPayload bool) rowJSON {
	created := r.CreatedAt
	d := rowJSON{ID: r.ID, Topic: r.Topic, UUID: r.UUID, State: ops.RowState(r), CreatedAt: jsonTime(&created),
		QuarantinedAt: jsonTime(r.QuarantinedAt), NextAttemptAt: jsonTime(r.NextAttemptAt), Failures: r.Failures,
		PermanentFailures: r.PermanentFailures, LastError: r.LastError, Metadata: r.Metadata, PayloadBytes: r.PayloadSize,
		OrderingKey: r.OrderingKey, Waiting: r.Waiting, Version: r.Version}
	if d.Metadata == nil {
		d.Metadata = map[string]string{}
	}
	if withPayload {
		d.Payload, d.PayloadTruncated = shownPayloadDoc(r.Payload, r.PayloadSize)
	}
	return d
}

func (a *app) outboxRows(ctx context.Context, db sqlschema.DB, f outbox.RowFilter, p outbox.Page) error {
	rows, err := ops.NewRows(db)
	if err != nil {
		return rowErr(ctx, db, "outbox rows", err)
	}
	page, err := rows.Find(ctx, f, p)
	if err != nil {
		return rowErr(ctx, db, "outbox rows", err)
	}
	if a.jsonOut {
		docs := make([]rowJSON, len(page.Rows))
		for i, r := range page.Rows {
			docs[i] = rowDoc(r, false)
		}
		return a.printJSON(struct {
			Rows []rowJSON `json:"rows"`
			Next int64     `json:"next_after,omitempty"`
		}{docs, nextRow(page)})
	}
	if len(page.Rows) == 0 {
		_, err := fmt.Fprintln(a.stdout, "No rows.")
		return err
	}
	tw := newTable(a.stdout)
	fmt.Fprintln(tw, "ID\tTOPIC\tUUID\tORDERING KEY\tWAITING\tSTATE\tFAILURES\tLAST ERROR")
	for _, r := range page.Rows {
		doc := rowDoc(r, false)
		key, waiting := "-", "-"
		if r.OrderingKey != "" {
			key, waiting = truncate(r.OrderingKey, 30), strconv.FormatInt(r.Waiting, 10)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%s\t%d (%d permanent)\t%s\n", r.ID, truncate(r.Topic, 40), truncate(r.UUID, 40),
			key, waiting, doc.State, r.Failures, r.PermanentFailures, truncate(r.LastError, 80))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if page.Next != "" {
		_, err = fmt.Fprintf(a.stdout, "\nMore: the same command with --after %s.\n", page.Next)
	}
	return err
}

func (a *app) outboxShow(ctx context.Context, db sqlschema.DB, id int64, full bool) error {
	rows, err := ops.NewRows(db)
	if err != nil {
		return rowErr(ctx, db, "outbox show", err)
	}
	var r outbox.Row
	if full {
		r, err = rows.Get(ctx, id)
	} else {
		r, err = rows.GetPrefix(ctx, id, showPayloadBytes)
	}
	if err != nil {
		return rowErr(ctx, db, "outbox show", err)
	}
	doc := rowDoc(r, true)
	if a.jsonOut {
		return a.printJSON(doc)
	}
	tw := newTable(a.stdout)
	fmt.Fprintf(tw, "id\t%d\n", r.ID)
	fmt.Fprintf(tw, "topic\t%s\n", r.Topic)
	fmt.Fprintf(tw, "uuid\t%s\n", r.UUID)
	fmt.Fprintf(tw, "state\t%s\n", doc.State)
	fmt.Fprintf(tw, "written\t%s\n", fmtTime(r.CreatedAt))
	if r.QuarantinedAt != nil {
		fmt.Fprintf(tw, "quarantined\t%s\n", fmtTime(*r.QuarantinedAt))
	}
	fmt.Fprintf(tw, "failures\t%d (%d permanent)\n", r.Failures, r.PermanentFailures)
	fmt.Fprintf(tw, "last error\t%s\n", r.LastError)
	fmt.Fprintf(tw, "version\t%s\n", r.Version)
	if r.OrderingKey != "" {
		fmt.Fprintf(tw, "ordering key\t%s\n", r.OrderingKey)
		if r.Failures > 0 {
			fmt.Fprintf(tw, "waiting\t%s of its key behind it, held back until it is published, requeued or discarded\n",
				plural(r.Waiting, "row", "rows"))
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err = fmt.Fprintf(a.stdout, "metadata:\n%spayload (%d bytes)%s\n", metadataLines(r.Metadata), r.PayloadSize,
		shownPayloadText(r.Payload, r.PayloadSize))
	return err
}

// rowAction requeues or discards one row (by id) or every row matching the
// criteria (with --yes; without, it says how many match).
func (a *app) rowAction(cmd *cobra.Command, args []string, f *rowFlags, cond ifFlags, verb string) error {
	if len(args) != 1 && cond.any() {
		return usageErr("--if-version is for one row (ID); a bulk action is bounded by its criteria")
	}
	return a.withOutbox(cmd, func(ctx context.Context, db sqlschema.DB) error {
		rows, err := ops.NewRows(db)
		if err != nil {
			return rowErr(ctx, db, "outbox "+verb, err)
		}
		if len(args) == 1 {
			if f.anyCriterion() || f.yes || f.confirm != "" {
				return usageErr("give a row id or criteria, not both")
			}
			id, err := rowID(args[0])
			if err != nil {
				return err
			}
			if err := rows.Act(ctx, verb, id, outbox.Expect{Version: cond.version}); err != nil {
				return rowErr(ctx, db, "outbox "+verb, err)
			}
			return a.actionDone(verb, 1, "row", "rows")
		}
		if !f.anyCriterion() {
			return usageErr("give a row id, or criteria (--topic, --uuid, --reason, --since, --until, --meta, --ordering-key) with --yes")
		}
		if _, err := f.filter(time.Now()); err != nil {
			return err // a usage error, before any round trip
		}
		build := func(asOf time.Time) (ops.Target, error) {
			filter, err := f.filter(asOf)
			filter.AsOf = asOf
			return ops.RowsBulk{Rows: rows, Filter: filter, Verb: verb}, err
		}
		target, c, act, err := f.confirmation(ctx, rows.Now, build, true)
		if err != nil {
			return rowErr(ctx, db, "outbox "+verb, err)
		}
		if !act {
			return a.wouldDo(verb, c, "row", "rows")
		}
		res, err := ops.Run(ctx, target, c)
		err = recount(ctx, err, rows.Now, build, true)
		n := res.Done
		if err != nil {
			return rowErr(ctx, db, fmt.Sprintf("outbox %s (%d done before the error)", verb, n), bulkErr(err))
		}
		if n == 0 {
			// One rule with the single form: nothing to act on is exit 3.
			return notFoundErr("outbox %s: no row matches the criteria: nothing done", verb)
		}
		return a.actionDone(verb, n, "row", "rows")
	})
}

// wouldDo reports a bulk action's count without acting, with its
// confirmation: --confirm acts on what it counted.
func (a *app) wouldDo(verb string, c ops.Confirmation, one, many string) error {
	n := c.Count
	if a.jsonOut {
		return a.printJSON(struct {
			Matching int64  `json:"matching"`
			Done     bool   `json:"done"`
			Confirm  string `json:"confirm"`
		}{n, false, c.Token()})
	}
	verbs := "match"
	if n == 1 {
		verbs = "matches"
	}
	_, err := fmt.Fprintf(a.stdout, "%s %s. Nothing done: the same command with --yes will %s them.\n", plural(n, one, many), verbs, verb)
	if err == nil && n > 0 {
		_, err = fmt.Fprintf(a.stdout, "To %s exactly these (refused, exit 4, if they changed): --confirm %s\n", verb, c.Token())
	}
	return err
}

// actionDone reports what an action did.
func (a *app) actionDone(verb string, n int64, one, many string) error {
	past := map[string]string{"requeue": "Requeued", "discard": "Discarded", "replay": "Replayed", "release": "Released"}[verb]
	if a.jsonOut {
		return a.printJSON(struct {
			Count int64 `json:"count"`
			Done  bool  `json:"done"`
		}{n, true})
	}
	_, err := fmt.Fprintf(a.stdout, "%s %s.\n", past, plural(n, one, many))
	return err
}

// rowErr maps the outbox functions' errors to exit codes.
func rowErr(ctx context.Context, db sqlschema.DB, what string, err error) error {
	switch {
	case errors.Is(err, outbox.ErrRowNotFound):
		return notFoundErr("%s: %v", what, err)
	case errors.Is(err, outbox.ErrNotQuarantined):
		return &exitError{code: exitFailed, err: fmt.Errorf("%s: %w", what, err)}
	}
	return opErr(ctx, db, what, err)
}

// afterID is the cursor of the page after row id (0: the first page).
func afterID(id int64) string {
	if id <= 0 {
		return ""
	}
	return strconv.FormatInt(id, 10)
}

// nextRow is the id after which the page after page starts; 0 when page is
// the last.
func nextRow(page outbox.RowPage) int64 {
	n, _ := strconv.ParseInt(page.Next, 10, 64)
	return n
}
