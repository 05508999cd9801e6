package main

import (
	"context"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/exactlyonce/watermill-exactlyonce/internal/ops"
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func (a *app) outboxCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "outbox",
		Short: "Report and repair the outbox backlog, and run the relay: stats, pending, rows, show, requeue, discard, requeue-failed, relay",
		Args:  cobra.ArbitraryArgs,
		RunE:  groupRunE,
	}

	var pend pendingOptions
	pending := &cobra.Command{
		Use:   "pending",
		Short: "List rows waiting for the relay, oldest first, with their failures and last error",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if pend.limit < 1 {
				return usageErr("--limit must be at least 1")
			}
			if pend.quarantined && pend.failing {
				return usageErr("--quarantined and --failing exclude each other")
			}
			return a.withOutbox(cmd, func(ctx context.Context, db sqlschema.DB) error {
				return a.outboxPending(ctx, db, pend)
			})
		},
	}
	pending.Flags().IntVar(&pend.limit, "limit", 50, "list at most this many rows")
	pending.Flags().BoolVar(&pend.quarantined, "quarantined", false, "only rows the relay gave up on (put back by requeue-failed)")
	pending.Flags().BoolVar(&pend.failing, "failing", false, "only rows retrying after failed publishes, not quarantined")

	cmd.AddCommand(
		&cobra.Command{
			Use:   "stats",
			Short: "Backlog: rows pending, age of the oldest, failing, quarantined, blocked ordering keys",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				return a.withOutbox(cmd, a.outboxStats)
			},
		},
		pending,
		&cobra.Command{
			Use:   "requeue-failed",
			Short: "Clear the failure record of every failing or quarantined row, so that the relay sends it again now",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				return a.withOutbox(cmd, a.outboxRequeue)
			},
		},
		a.relayCmd(),
	)
	cmd.AddCommand(a.rowCmds()...)
	return cmd
}

// withOutbox connects, checks the migrations and runs f.
func (a *app) withOutbox(cmd *cobra.Command, f func(context.Context, sqlschema.DB) error) error {
	ctx, cancel := a.opContext(cmd, false)
	defer cancel()
	db, closeDB, err := a.open(ctx, cmd, 2, true)
	if err != nil {
		return err
	}
	defer closeDB()
	return f(ctx, db)
}

func (a *app) outboxStats(ctx context.Context, db sqlschema.DB) error {
	rows, err := ops.NewRows(db)
	if err != nil {
		return opErr(ctx, db, "outbox stats", err)
	}
	p, err := rows.Pending(ctx)
	if err != nil {
		return opErr(ctx, db, "outbox stats", err)
	}
	if a.jsonOut {
		return a.printJSON(struct {
			Pending          int64   `json:"pending"`
			OldestCreatedAt  *string `json:"oldest_created_at"`
			OldestAgeSeconds float64 `json:"oldest_age_seconds"`
			Failing          int64   `json:"failing"`
			Quarantined      int64   `json:"quarantined"`
			BlockedKeys      int64   `json:"blocked_keys"`
			BlockedRows      int64   `json:"blocked_rows"`
		}{p.Count, jsonTime(p.OldestCreatedAt), p.OldestAge.Seconds(), p.Failing, p.Quarantined, p.BlockedKeys, p.Blocked})
	}
	tw := newTable(a.stdout)
	fmt.Fprintf(tw, "Outbox %s.%s\n", db.Schema, db.OutboxTable)
	fmt.Fprintf(tw, "pending\t%d\t(quarantined included)\n", p.Count)
	if p.OldestCreatedAt != nil {
		fmt.Fprintf(tw, "oldest\t%s\t(relay lag; quarantined rows excluded)\n", fmtDuration(p.OldestAge))
	} else {
		fmt.Fprintf(tw, "oldest\t-\t\n")
	}
	fmt.Fprintf(tw, "failing\t%d\t(retrying with backoff)\n", p.Failing)
	fmt.Fprintf(tw, "quarantined\t%d\t(skipped until requeue-failed)\n", p.Quarantined)
	fmt.Fprintf(tw, "blocked keys\t%d\t(ordering keys held back by a failing or quarantined row)\n", p.BlockedKeys)
	fmt.Fprintf(tw, "blocked rows\t%d\t(waiting behind such a row of their key)\n", p.Blocked)
	if p.Quarantined > 0 || p.Failing > 0 {
		fmt.Fprintf(tw, "\nRead their errors: exactlyonce outbox pending --quarantined (or --failing); after a fix: exactlyonce outbox requeue-failed\n")
	}
	if p.BlockedKeys > 0 {
		fmt.Fprintf(tw, "Blocked keys: exactlyonce outbox rows --state all lists the failed rows with their ordering key and the rows waiting behind each; requeue or discard one to unblock its key\n")
	}
	return tw.Flush()
}

func (a *app) outboxRequeue(ctx context.Context, db sqlschema.DB) error {
	rows, err := ops.NewRows(db)
	if err != nil {
		return opErr(ctx, db, "outbox requeue-failed", err)
	}
	n, err := rows.RequeueFailed(ctx)
	if err != nil {
		return opErr(ctx, db, "outbox requeue-failed", err)
	}
	if a.jsonOut {
		return a.printJSON(struct {
			Requeued int64 `json:"requeued"`
		}{n})
	}
	if n == 0 {
		_, err = fmt.Fprintln(a.stdout, "No failing or quarantined rows: nothing to requeue.")
		return err
	}
	_, err = fmt.Fprintf(a.stdout, "Requeued %s: the relay sends them again now.\n", plural(n, "row", "rows"))
	return err
}

type pendingOptions struct {
	limit                int
	quarantined, failing bool
}

// pendingRow is one outbox row in `outbox pending`, also its --json form.
type pendingRow struct {
	ID                int64   `json:"id"`
	Topic             string  `json:"topic"`
	UUID              string  `json:"uuid"`
	State             string  `json:"state"` // ready, blocked, backoff, quarantined
	CreatedAt         *string `json:"created_at"`
	AgeSeconds        float64 `json:"age_seconds"`
	PayloadBytes      int64   `json:"payload_bytes"`
	Failures          int     `json:"failures"`
	PermanentFailures int     `json:"permanent_failures"`
	NextAttemptAt     *string `json:"next_attempt_at"`
	QuarantinedAt     *string `json:"quarantined_at"`
	LastError         string  `json:"last_error"`
	OrderingKey       string  `json:"ordering_key"` // "" when none

	nextIn  float64
	blocked bool
}

func (a *app) outboxPending(ctx context.Context, db sqlschema.DB, opts pendingOptions) error {
	state := ""
	switch {
	case opts.quarantined:
		state = outboxdb.StateQuarantined
	case opts.failing:
		state = outboxdb.StateFailing
	}
	// Ages are the database's (now()), like PendingStats, whatever this
	// machine's clock says. A row is blocked as PendingStats counts it:
	// it never failed, and waits behind a failed row of its ordering key
	// (internal/outboxdb's PendingRows).
	st, err := outboxdb.New(db)
	if err != nil {
		return opErr(ctx, db, "outbox pending", err)
	}
	rows, err := st.PendingRows(ctx, db.Conn, state, opts.limit)
	if err != nil {
		return opErr(ctx, db, "outbox pending", err)
	}
	var out []pendingRow
	for _, p := range rows {
		created := p.CreatedAt
		r := pendingRow{ID: p.ID, Topic: p.Topic, UUID: p.UUID, AgeSeconds: p.AgeSeconds, PayloadBytes: p.PayloadBytes,
			Failures: p.Failures, PermanentFailures: p.PermanentFailures, LastError: p.LastError, OrderingKey: p.OrderingKey,
			nextIn: p.NextInSeconds, blocked: p.Blocked}
		r.CreatedAt, r.NextAttemptAt, r.QuarantinedAt = jsonTime(&created), jsonTime(p.NextAttemptAt), jsonTime(p.QuarantinedAt)
		r.State = ops.PendingState(p.QuarantinedAt != nil, r.Failures, r.blocked)
		out = append(out, r)
	}
	if a.jsonOut {
		return a.printJSON(struct {
			Count int          `json:"count"`
			Limit int          `json:"limit"`
			Rows  []pendingRow `json:"rows"`
		}{len(out), opts.limit, nonNil(out)})
	}
	if len(out) == 0 {
		_, err := fmt.Fprintln(a.stdout, "No rows.")
		return err
	}
	tw := newTable(a.stdout)
	fmt.Fprintln(tw, "ID\tTOPIC\tUUID\tAGE\tSTATE\tFAILURES\tLAST ERROR")
	for _, r := range out {
		state := r.State
		switch {
		case state == ops.RowFailing && r.nextIn > 0:
			state = "retry in " + fmtDuration(time.Duration(r.nextIn*float64(time.Second)))
		case state == ops.RowBlocked:
			state = "blocked (key " + truncate(r.OrderingKey, 30) + ")"
		}
		lastErr := r.LastError
		if lastErr == "" {
			lastErr = "-"
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%s\t%d (%d permanent)\t%s\n", r.ID, truncate(r.Topic, 40), truncate(r.UUID, 40),
			fmtDuration(time.Duration(r.AgeSeconds*float64(time.Second))), state, r.Failures, r.PermanentFailures, truncate(lastErr, 80))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(out) == opts.limit {
		_, err = fmt.Fprintf(a.stdout, "\nThe first %d rows; --limit for more, 'exactlyonce outbox stats' for the totals.\n", opts.limit)
	}
	return err
}
