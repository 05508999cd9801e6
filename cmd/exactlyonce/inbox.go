package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/ops"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func (a *app) inboxCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "inbox",
		Short: "Inspect and repair the inbox: stats, show, forget, parked, release, purge",
		Long: `Inspect and repair the inbox. Records are keyed by consumer (the handler's name, or
exactlyonce.Config.Consumer) and message key (the message UUID unless Config.Key says otherwise).
A consumer with no record at all (a misspelled -c) is an error, exit status 3, that lists the
consumers that have records. A key that starts with '-' goes after '--':
exactlyonce inbox show -c orders -- -odd-key`,
		Args: cobra.ArbitraryArgs,
		RunE: groupRunE,
	}
	var consumer string
	consumerFlag := func(c *cobra.Command, required bool) *cobra.Command {
		if required {
			c.Flags().StringVarP(&consumer, "consumer", "c", "", "consumer the key is recorded under (required)")
		} else {
			c.Flags().StringVarP(&consumer, "consumer", "c", "", "only this consumer (default: every consumer)")
		}
		return c
	}
	var tenant string
	tenantFlag := func(c *cobra.Command, usage string) *cobra.Command {
		c.Flags().StringVar(&tenant, "tenant", "", usage)
		return c
	}
	needConsumer := func() error {
		if consumer == "" {
			return usageErr("--consumer is required: records are keyed by (consumer, key)")
		}
		return nil
	}
	// scoped is KEY as recorded: within --tenant when given.
	scoped := func(key string) (string, error) {
		if tenant == "" {
			return key, nil
		}
		k, err := inbox.TenantKey(tenant, key)
		if err != nil {
			return "", usageErr("--tenant: %v", strings.TrimPrefix(err.Error(), "inbox: TenantKey: "))
		}
		return k, nil
	} // keyCmd is a command on one key of one consumer: show, forget,
	// release.
	keyCmd := func(use, short string, run func(ctx context.Context, db sqlschema.DB, s *inbox.Store, consumer, key string) error) *cobra.Command {
		return tenantFlag(consumerFlag(&cobra.Command{
			Use:   use,
			Short: short,
			Args:  cobra.ArbitraryArgs,
			RunE: func(cmd *cobra.Command, args []string) error {
				key, err := requireArg(args, "KEY")
				if err == nil {
					err = needConsumer()
				}
				if err == nil {
					key, err = scoped(key)
				}
				if err != nil {
					return err
				}
				return a.withStore(cmd, false, func(ctx context.Context, db sqlschema.DB, s *inbox.Store) error {
					return run(ctx, db, s, consumer, key)
				})
			},
		}, true), "the key's tenant (keys scoped by exactlyonce.KeyByTenant): KEY is the key within it, recorded as TENANT:KEY")
	}

	var limit int
	parked := consumerFlag(&cobra.Command{
		Use:   "parked",
		Short: "List parked keys, oldest first, with the reason",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if limit < 1 {
				return usageErr("--limit must be at least 1")
			}
			return a.withStore(cmd, false, func(ctx context.Context, db sqlschema.DB, s *inbox.Store) error {
				return a.inboxParked(ctx, db, s, consumer, limit)
			})
		},
	}, false)
	parked.Flags().IntVar(&limit, "limit", 100, "list at most this many")

	var purge inbox.PurgeOptions
	var olderThan string
	purgeCmd := tenantFlag(consumerFlag(&cobra.Command{
		Use:   "purge --older-than DURATION",
		Short: "Delete done and failed records that finished more than DURATION ago (never processing or parked ones)",
		Long: `Delete done and failed records that finished (processed_at) more than DURATION ago, in short
batches. Processing and parked records are never purged. Choose DURATION longer than the longest
time your broker may still redeliver a processed message: a purged key runs again if its message
comes back. DURATION is a Go duration with an optional leading number of days: 720h, 30d, 1d12h.
It runs until done (or --max-batches, --timeout, Ctrl-C) and prints the number of records deleted.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if olderThan == "" {
				return usageErr("--older-than is required (e.g. --older-than 30d)")
			}
			d, err := parseAge(olderThan)
			if err != nil {
				return usageErr("--older-than: %v", err)
			}
			if d <= 0 {
				return usageErr("--older-than must be positive")
			}
			if purge.BatchSize < 1 || purge.MaxBatches < 0 {
				return usageErr("--batch-size must be at least 1 and --max-batches at least 0")
			}
			purge.OlderThan, purge.Consumer, purge.Tenant = d, consumer, tenant
			return a.withStore(cmd, true, func(ctx context.Context, db sqlschema.DB, s *inbox.Store) error {
				return a.inboxPurge(ctx, db, s, purge)
			})
		},
	}, false), "delete only this tenant's records (keys scoped by exactlyonce.KeyByTenant)")
	purgeCmd.Flags().StringVar(&olderThan, "older-than", "", "age of the records to delete, since they finished: 720h, 30d (required)")
	purgeCmd.Flags().IntVar(&purge.BatchSize, "batch-size", 1000, "records deleted per statement")
	purgeCmd.Flags().IntVar(&purge.MaxBatches, "max-batches", 0, "stop after this many batches (0: until done)")

	var forgetIf, releaseIf ifFlags
	forgetCmd := keyCmd("forget --consumer C KEY", "Delete the record of one key, with its parked message if it has one, so that its next delivery runs the handler again (exit status 3 when there is none)",
		func(ctx context.Context, db sqlschema.DB, s *inbox.Store, consumer, key string) error {
			return a.inboxForget(ctx, db, s, consumer, key, forgetIf.expect())
		})
	forgetIf.register(forgetCmd, "exactlyonce inbox show", true)
	releaseCmd := keyCmd("release --consumer C KEY", "Release a parked key, so that its next delivery runs again (exit status 3 when it is not parked)",
		func(ctx context.Context, db sqlschema.DB, s *inbox.Store, consumer, key string) error {
			return a.inboxRelease(ctx, db, s, consumer, key, releaseIf.expect())
		})
	releaseIf.register(releaseCmd, "exactlyonce inbox show", true)

	cmd.AddCommand(
		tenantFlag(consumerFlag(&cobra.Command{
			Use:   "stats",
			Short: "Count records by status, with duplicates seen and the oldest record",
			Args:  cobra.NoArgs,
			RunE: func(cmd *cobra.Command, _ []string) error {
				return a.withStore(cmd, false, func(ctx context.Context, db sqlschema.DB, s *inbox.Store) error {
					return a.inboxStats(ctx, db, s, consumer, tenant)
				})
			},
		}, false), "count only this tenant's keys (keys scoped by exactlyonce.KeyByTenant)"),
		keyCmd("show --consumer C KEY", "Show the record of one key (exit status 3 when there is none)", a.inboxShow),
		forgetCmd,
		parked,
		releaseCmd,
		purgeCmd,
	)
	return cmd
}

// withStore connects, checks the migrations and runs f with an inbox.Store.
func (a *app) withStore(cmd *cobra.Command, unbounded bool, f func(context.Context, sqlschema.DB, *inbox.Store) error) error {
	ctx, cancel := a.opContext(cmd, unbounded)
	defer cancel()
	db, closeDB, err := a.open(ctx, cmd, 2, true)
	if err != nil {
		return err
	}
	defer closeDB()
	s, err := inbox.NewStore(db)
	if err != nil {
		return err
	}
	return f(ctx, db, s)
}

// recordJSON is an inbox record in --json output.
type recordJSON struct {
	Consumer      string  `json:"consumer"`
	Key           string  `json:"key"`
	Status        string  `json:"status"`
	Attempts      int     `json:"attempts"`
	Duplicates    int64   `json:"duplicates"`
	FirstSeenAt   *string `json:"first_seen_at"`
	ProcessedAt   *string `json:"processed_at"`
	LeaseUntil    *string `json:"lease_until"`
	LastError     string  `json:"last_error"`
	Interrupted   bool    `json:"interrupted"`
	Interruptions int     `json:"interruptions"`
	Version       string  `json:"version"`
}

func toRecordJSON(r inbox.Record) recordJSON {
	return recordJSON{Consumer: r.Consumer, Key: r.Key, Status: r.Status, Attempts: r.Attempts, Duplicates: r.Duplicates,
		FirstSeenAt: jsonTime(&r.FirstSeenAt), ProcessedAt: jsonTime(r.ProcessedAt), LeaseUntil: jsonTime(r.LeaseUntil),
		LastError: r.LastError, Interrupted: r.Interrupted, Interruptions: r.Interruptions, Version: r.Version}
}

func (a *app) inboxStats(ctx context.Context, db sqlschema.DB, s *inbox.Store, consumer, tenant string) error {
	var st inbox.Stats
	var err error
	if tenant != "" {
		if _, kerr := inbox.TenantKey(tenant, "k"); kerr != nil {
			return usageErr("--tenant: %v", strings.TrimPrefix(kerr.Error(), "inbox: TenantKey: "))
		}
		st, err = s.TenantStats(ctx, consumer, tenant)
	} else {
		st, err = s.Stats(ctx, consumer)
	}
	if err != nil {
		return opErr(ctx, db, "inbox stats", err)
	}
	if consumer != "" && st.Total == 0 {
		if err := checkConsumer(ctx, db, consumer); err != nil {
			return err
		}
	}
	rows := map[string]int64{}
	for _, k := range ops.KeyStates() {
		rows[k] = st.Rows[k]
	}
	for k, v := range st.Rows { // a status of a later version, if any
		rows[k] = v
	}
	if a.jsonOut {
		return a.printJSON(struct {
			Consumer        string           `json:"consumer"`
			Tenant          string           `json:"tenant,omitempty"`
			Total           int64            `json:"total"`
			Rows            map[string]int64 `json:"rows"`
			Duplicates      int64            `json:"duplicates"`
			OldestFirstSeen *string          `json:"oldest_first_seen_at"`
		}{consumer, tenant, st.Total, rows, st.Duplicates, jsonTime(st.OldestFirstSeen)})
	}
	who := "every consumer"
	if consumer != "" {
		who = fmt.Sprintf("consumer %q", consumer)
	}
	if tenant != "" {
		who += fmt.Sprintf(", tenant %q", tenant)
	}
	tw := newTable(a.stdout)
	fmt.Fprintf(tw, "Inbox %s.%s, %s\n", db.Schema, db.InboxTable, who)
	fmt.Fprintf(tw, "records\t%d\n", st.Total)
	for _, k := range ops.KeyStates() {
		fmt.Fprintf(tw, "  %s\t%d\n", k, rows[k])
	}
	for k, v := range rows {
		if !isKnownStatus(k) {
			fmt.Fprintf(tw, "  %s\t%d\n", k, v)
		}
	}
	fmt.Fprintf(tw, "duplicates dropped\t%d\n", st.Duplicates)
	oldest := "-"
	if st.OldestFirstSeen != nil {
		oldest = fmtTimeAgo(*st.OldestFirstSeen, time.Now())
	}
	fmt.Fprintf(tw, "oldest record\t%s\n", oldest)
	if rows[ops.KeyParked] > 0 {
		fmt.Fprintf(tw, "\nParked keys wait for an operator: exactlyonce inbox parked\n")
	}
	return tw.Flush()
}

func isKnownStatus(s string) bool {
	for _, k := range ops.KeyStates() {
		if k == s {
			return true
		}
	}
	return false
}

func (a *app) inboxShow(ctx context.Context, db sqlschema.DB, s *inbox.Store, consumer, key string) error {
	r, err := s.Get(ctx, consumer, key)
	if errors.Is(err, inbox.ErrNotFound) {
		if err := checkConsumer(ctx, db, consumer); err != nil {
			return err
		}
		return notFoundErr("no inbox record for consumer %q, key %q", consumer, key)
	}
	if err != nil {
		return opErr(ctx, db, "inbox show", err)
	}
	if a.jsonOut {
		return a.printJSON(toRecordJSON(r))
	}
	now := time.Now()
	tw := newTable(a.stdout)
	fmt.Fprintf(tw, "consumer\t%s\n", r.Consumer)
	fmt.Fprintf(tw, "key\t%s\n", r.Key)
	fmt.Fprintf(tw, "status\t%s\n", r.Status)
	fmt.Fprintf(tw, "attempts\t%d\n", r.Attempts)
	fmt.Fprintf(tw, "duplicates\t%d\n", r.Duplicates)
	fmt.Fprintf(tw, "first seen\t%s\n", fmtTimeAgo(r.FirstSeenAt, now))
	if r.ProcessedAt != nil {
		fmt.Fprintf(tw, "finished\t%s\n", fmtTimeAgo(*r.ProcessedAt, now))
	} else {
		fmt.Fprintf(tw, "finished\t-\n")
	}
	if r.LeaseUntil != nil {
		fmt.Fprintf(tw, "lease until\t%s\n", fmtTime(*r.LeaseUntil))
	}
	if r.Interruptions > 0 || r.Interrupted {
		fmt.Fprintf(tw, "interruptions\t%d (latest attempt interrupted: %t)\n", r.Interruptions, r.Interrupted)
	}
	if r.LastError != "" {
		fmt.Fprintf(tw, "last error\t%s\n", oneLine(r.LastError))
	}
	fmt.Fprintf(tw, "version\t%s\n", r.Version)
	switch r.Status {
	case ops.KeyParked:
		fmt.Fprintf(tw, "\nParked: 'exactlyonce inbox release -c %s %s' lets its next delivery run.\n", shellQuote(consumer), keyArg(key))
	case ops.KeyDone:
		fmt.Fprintf(tw, "\nDone: deliveries of this key are dropped as duplicates ('exactlyonce inbox forget' to run it again).\n")
	case ops.KeyDiscarded:
		fmt.Fprintf(tw, "\nDiscarded: an operator discarded its parked message; deliveries of this key are dropped as duplicates ('exactlyonce inbox forget' to run it again).\n")
	}
	return tw.Flush()
}

func (a *app) inboxForget(ctx context.Context, db sqlschema.DB, s *inbox.Store, consumer, key string, expect inbox.Expect) error {
	ok, err := s.Forget(ctx, consumer, key, expect)
	if errors.Is(err, inbox.ErrNotFound) {
		ok, err = false, nil
	}
	if err != nil {
		return opErr(ctx, db, "inbox forget", err)
	}
	if !ok {
		if err := checkConsumer(ctx, db, consumer); err != nil {
			return err
		}
		return notFoundErr("no inbox record for consumer %q, key %q: nothing to forget", consumer, key)
	}
	if a.jsonOut {
		return a.printJSON(struct {
			Consumer  string `json:"consumer"`
			Key       string `json:"key"`
			Forgotten bool   `json:"forgotten"`
		}{consumer, key, true})
	}
	_, err = fmt.Fprintf(a.stdout, "Forgot consumer %q, key %q: its next delivery runs the handler again.\n", consumer, key)
	return err
}

func (a *app) inboxParked(ctx context.Context, db sqlschema.DB, s *inbox.Store, consumer string, limit int) error {
	rs, err := s.Parked(ctx, consumer, limit)
	if err != nil {
		return opErr(ctx, db, "inbox parked", err)
	}
	if len(rs) == 0 && consumer != "" {
		if err := checkConsumer(ctx, db, consumer); err != nil {
			return err
		}
	}
	if a.jsonOut {
		out := make([]recordJSON, len(rs))
		for i, r := range rs {
			out[i] = toRecordJSON(r)
		}
		return a.printJSON(struct {
			Consumer string       `json:"consumer"`
			Count    int          `json:"count"`
			Limit    int          `json:"limit"`
			Records  []recordJSON `json:"records"`
		}{consumer, len(rs), limit, out})
	}
	if len(rs) == 0 {
		_, err := fmt.Fprintln(a.stdout, "No parked keys.")
		return err
	}
	now := time.Now()
	tw := newTable(a.stdout)
	fmt.Fprintln(tw, "CONSUMER\tKEY\tATTEMPTS\tPARKED\tREASON")
	for _, r := range rs {
		parkedAt := "-"
		if r.ProcessedAt != nil {
			parkedAt = fmtDuration(now.Sub(*r.ProcessedAt)) + " ago"
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\n", truncate(r.Consumer, 40), truncate(r.Key, 60), r.Attempts, parkedAt, truncate(r.LastError, 80))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	more := ""
	if len(rs) == limit {
		more = fmt.Sprintf(" (the first %d; --limit for more)", limit)
	}
	_, err = fmt.Fprintf(a.stdout, "\n%d parked%s. Fix the cause, then: exactlyonce inbox release -c CONSUMER KEY\n", len(rs), more)
	return err
}

func (a *app) inboxRelease(ctx context.Context, db sqlschema.DB, s *inbox.Store, consumer, key string, expect inbox.Expect) error {
	ok, err := s.Release(ctx, consumer, key, expect)
	if errors.Is(err, inbox.ErrNotFound) {
		ok, err = false, nil
	}
	if err != nil {
		return opErr(ctx, db, "inbox release", err)
	}
	if !ok {
		r, err := s.Get(ctx, consumer, key)
		switch {
		case errors.Is(err, inbox.ErrNotFound):
			if err := checkConsumer(ctx, db, consumer); err != nil {
				return err
			}
			return notFoundErr("no inbox record for consumer %q, key %q: nothing to release", consumer, key)
		case err != nil:
			return opErr(ctx, db, "inbox release", err)
		}
		return notFoundErr("consumer %q, key %q is %s, not parked: nothing to release", consumer, key, r.Status)
	}
	if a.jsonOut {
		return a.printJSON(struct {
			Consumer string `json:"consumer"`
			Key      string `json:"key"`
			Released bool   `json:"released"`
		}{consumer, key, true})
	}
	_, err = fmt.Fprintf(a.stdout, "Released consumer %q, key %q: its next delivery runs again.\n", consumer, key)
	return err
}

func (a *app) inboxPurge(ctx context.Context, db sqlschema.DB, s *inbox.Store, opts inbox.PurgeOptions) error {
	if opts.Consumer != "" {
		// A note, not a failure: a scheduled purge of a consumer whose
		// records an earlier run removed (an idle one) must not fail.
		if err := checkConsumer(ctx, db, opts.Consumer); err != nil {
			var ee *exitError
			if !errors.As(err, &ee) || ee.code != exitNotFound {
				return err
			}
			fmt.Fprintf(a.stderr, "exactlyonce: note: %s\n", oneLine(strings.TrimPrefix(err.Error(), "exactlyonce: ")))
		}
	}
	start := time.Now()
	n, err := s.Purge(ctx, opts)
	complete := err == nil
	if err != nil && n == 0 {
		return opErr(ctx, db, "inbox purge", err)
	}
	if a.jsonOut {
		if perr := a.printJSON(struct {
			Consumer  string  `json:"consumer"`
			OlderThan string  `json:"older_than"`
			Deleted   int64   `json:"deleted"`
			Complete  bool    `json:"complete"`
			Seconds   float64 `json:"seconds"`
		}{opts.Consumer, opts.OlderThan.String(), n, complete, time.Since(start).Seconds()}); perr != nil {
			return perr
		}
	} else {
		fmt.Fprintf(a.stdout, "Purged %s that finished more than %s ago (%s).\n", plural(n, "record", "records"), fmtDuration(opts.OlderThan), fmtDuration(time.Since(start)))
	}
	if !complete {
		return opErr(ctx, db, fmt.Sprintf("inbox purge stopped after %d records", n), err)
	}
	return nil
}

// keyArg is key as a command-line argument: quoted, after "--" when it
// starts with a dash.
func keyArg(key string) string {
	if strings.HasPrefix(key, "-") {
		return "-- " + shellQuote(key)
	}
	return shellQuote(key)
}

// shellQuote quotes s for a shell command line when it needs it.
func shellQuote(s string) string {
	if s != "" && !strings.ContainsFunc(s, needsQuote) {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// needsQuote reports whether r is special to a shell (or not plain ASCII).
func needsQuote(r rune) bool {
	switch {
	case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9':
		return false
	case strings.ContainsRune("-_./:@+=,", r):
		return false
	}
	return true
}
