package main

import (
	"context"
	stdsql "database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/mysqldsn"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// Exit codes.
const (
	exitOK       = 0
	exitFailed   = 1 // the operation failed: database down, not migrated, relay failures
	exitUsage    = 2 // bad flags, missing or empty arguments
	exitNotFound = 3 // nothing to act on: no such record, parked message or row, no message or row matching a bulk action's criteria; any command but inbox purge: unknown consumer (no records)
	exitChanged  = 4 // an --if-* precondition no longer holds: the key, message or row changed since it was shown; nothing done
)

// Environment variables read when the matching flag is not given.
const (
	envDatabaseURL = "DATABASE_URL"
	envAMQPURL     = "AMQP_URL"
	envSchema      = "EXACTLYONCE_SCHEMA"
	envInboxTable  = "EXACTLYONCE_INBOX_TABLE"
	envOutboxTable = "EXACTLYONCE_OUTBOX_TABLE"
	envPartitions  = "EXACTLYONCE_PARTITIONS"
	envDialect     = "EXACTLYONCE_DIALECT"
)

// exitError carries the exit code of a failed command.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

func usageErr(format string, args ...any) error {
	return &exitError{code: exitUsage, err: fmt.Errorf(format, args...)}
}

func notFoundErr(format string, args ...any) error {
	return &exitError{code: exitNotFound, err: fmt.Errorf(format, args...)}
}

// app is one invocation: the global flags and the output streams.
type app struct {
	stdout, stderr io.Writer

	databaseURL    string
	schema         string
	inboxTable     string
	outboxTable    string
	partitions     string
	dialect        string
	ahead          int
	jsonOut        bool
	timeout        time.Duration
	connectTimeout time.Duration

	// ctx ends on SIGINT or SIGTERM; stopSignals restores the default
	// handling (a second signal then kills the process).
	ctx         context.Context
	stopSignals context.CancelFunc
}

// run executes the command line args and returns the exit code.
func run(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	a := &app{stdout: stdout, stderr: stderr, ctx: ctx, stopSignals: stop}
	root := a.rootCmd()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	cmd, err := root.ExecuteC()
	if err == nil {
		return exitOK
	}
	code := exitUsage // errors cobra returns itself: unknown commands, flags, arguments
	var ee *exitError
	if errors.As(err, &ee) {
		code = ee.code
	}
	fmt.Fprintf(stderr, "exactlyonce: %s\n", oneLine(err.Error()))
	if code == exitUsage && cmd != nil {
		fmt.Fprintf(stderr, "Run '%s --help' for usage.\n", cmd.CommandPath())
	}
	return code
}

// oneLine folds an error's text to one line, dropping lines that repeat an
// earlier one (pgx reports each connection attempt on a line of its own,
// and with sslmode=prefer both attempts fail alike).
func oneLine(s string) string {
	var out []string
	seen := map[string]bool{}
	for _, line := range strings.Split(s, "\n") {
		line = strings.Join(strings.Fields(line), " ")
		if line == "" || seen[line] {
			continue
		}
		seen[line] = true
		out = append(out, line)
	}
	return strings.Join(out, " ")
}

func (a *app) rootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:   "exactlyonce",
		Short: "Operate the inbox and outbox tables of watermill-exactlyonce",
		Long: `exactlyonce migrates, inspects and repairs the PostgreSQL or MySQL/MariaDB tables of
watermill-exactlyonce, and runs the outbox relay standalone.

The database is --database-url or $DATABASE_URL: postgres://... or mysql://... (which also selects
the MySQL dialect; 'migrate sql' without a database takes --dialect mysql); the schema and table names default like the
library's sqlschema.DB (public, watermill_inbox, watermill_outbox) and are read from
$EXACTLYONCE_SCHEMA, $EXACTLYONCE_INBOX_TABLE and $EXACTLYONCE_OUTBOX_TABLE when the flags are
not given. --json prints one JSON document per command. Exit status: 0 ok, 1 the operation
failed, 2 usage error, 3 no such record, or a consumer with no records at all (a misspelled -c).`,
		SilenceErrors: true,
		SilenceUsage:  true,
		Args:          cobra.NoArgs,
		RunE:          groupRunE,
		// No completion command: one fewer thing to explain.
		CompletionOptions: cobra.CompletionOptions{DisableDefaultCmd: true},
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error {
		return &exitError{code: exitUsage, err: err}
	})
	f := root.PersistentFlags()
	f.StringVar(&a.databaseURL, "database-url", "", "database URL, postgres://user:password@host:5432/db or mysql://user:password@host:3306/db (default $"+envDatabaseURL+")")
	f.StringVar(&a.dialect, "dialect", "", "postgres or mysql (default $"+envDialect+", else the --database-url's scheme, else postgres)")
	f.StringVar(&a.schema, "schema", "", "schema of the tables (default $"+envSchema+", else public)")
	f.StringVar(&a.inboxTable, "inbox-table", "", "inbox table name (default $"+envInboxTable+", else watermill_inbox)")
	f.StringVar(&a.outboxTable, "outbox-table", "", "outbox table name (default $"+envOutboxTable+", else watermill_outbox)")
	f.StringVar(&a.partitions, "partitions", "", "the inbox's partitioned layout, as the service's sqlschema.DB.Partitions: daily or hourly (default $"+envPartitions+", else the plain table)")
	f.IntVar(&a.ahead, "partitions-ahead", 3, "with --partitions: partitions created ahead (Partitioning.Ahead)")
	f.BoolVar(&a.jsonOut, "json", false, "print one JSON document instead of text")
	f.DurationVar(&a.timeout, "timeout", 30*time.Second, "give up on the command after this long (0: never; inbox purge and outbox relay: never unless given)")
	f.DurationVar(&a.connectTimeout, "connect-timeout", 5*time.Second, "give up connecting to the database after this long")

	root.AddCommand(a.migrateCmd(), a.inboxCmd(), a.outboxCmd(), a.parkedCmd(), a.uiCmd())
	failuresExit(root)
	return root
}

// groupRunE is the RunE of a command that only groups subcommands: called
// without one, or with an unknown one, it is a usage error (cobra would
// print the help and succeed).
func groupRunE(cmd *cobra.Command, args []string) error {
	var names []string
	for _, c := range cmd.Commands() {
		if c.IsAvailableCommand() {
			names = append(names, c.Name())
		}
	}
	if len(args) > 0 {
		return usageErr("unknown command %q for %q (one of: %s)", args[0], cmd.CommandPath(), strings.Join(names, ", "))
	}
	return usageErr("missing command (one of: %s)", strings.Join(names, ", "))
}

// failuresExit makes every error a RunE of cmd or its subcommands returns
// an exit status 1 unless it carries its own; the errors cobra returns
// itself (flags, unknown commands, arguments) stay usage errors.
func failuresExit(cmd *cobra.Command) {
	if run := cmd.RunE; run != nil {
		cmd.RunE = func(c *cobra.Command, args []string) error {
			err := run(c, args)
			var ee *exitError
			switch {
			case err == nil, errors.As(err, &ee):
			case errors.Is(err, inbox.ErrChanged): // outbox.ErrChanged too
				return &exitError{code: exitChanged, err: err}
			case errors.Is(err, inbox.ErrInvalidFilter): // a malformed request, such as a version of another kind
				return &exitError{code: exitUsage, err: err}
			default:
				return &exitError{code: exitFailed, err: err}
			}
			return err
		}
	}
	for _, c := range cmd.Commands() {
		failuresExit(c)
	}
}

// opContext returns the context of a one-shot operation: ended by a signal,
// and by --timeout. unbounded commands (purge, relay) get the timeout only
// when --timeout was given.
func (a *app) opContext(cmd *cobra.Command, unbounded bool) (context.Context, context.CancelFunc) {
	if a.timeout <= 0 || (unbounded && !cmd.Flags().Changed("timeout")) {
		return context.WithCancel(a.ctx)
	}
	return context.WithTimeout(a.ctx, a.timeout)
}

// names returns the schema and table names from the flags, the environment
// and the library's defaults, validated.
func (a *app) names(cmd *cobra.Command) (sqlschema.DB, error) {
	dialect, err := a.dialectOf(cmd)
	if err != nil {
		return sqlschema.DB{}, err
	}
	db := sqlschema.DB{
		Dialect:     dialect,
		Schema:      flagOrEnv(cmd.Flags(), "schema", a.schema, envSchema),
		InboxTable:  flagOrEnv(cmd.Flags(), "inbox-table", a.inboxTable, envInboxTable),
		OutboxTable: flagOrEnv(cmd.Flags(), "outbox-table", a.outboxTable, envOutboxTable),
	}
	switch p := flagOrEnv(cmd.Flags(), "partitions", a.partitions, envPartitions); p {
	case "":
	case string(sqlschema.Daily), string(sqlschema.Hourly):
		if dialect == sqlschema.MySQL {
			return db, usageErr("--partitions %s (or $%s): the time-partitioned inbox is PostgreSQL only (docs/mysql.md); on MySQL/MariaDB the inbox is the plain table: leave it empty", p, envPartitions)
		}
		db.Partitions = &sqlschema.Partitioning{Interval: sqlschema.PartitionInterval(p), Ahead: a.ahead}
	default:
		return db, usageErr("--partitions is %q: daily or hourly (or empty for the plain table)", p)
	}
	db = db.WithDefaults()
	if err := db.Validate(); err != nil {
		return db, usageErr("%s", strings.TrimPrefix(err.Error(), "sqlschema: "))
	}
	return db, nil
}

// dialectOf is the dialect of --dialect, else the database URL's scheme
// (mysql:// is MySQL), else PostgreSQL. A --dialect that contradicts the
// URL is a usage error.
func (a *app) dialectOf(cmd *cobra.Command) (sqlschema.Dialect, error) {
	url := flagOrEnv(cmd.Flags(), "database-url", a.databaseURL, envDatabaseURL)
	fromURL := sqlschema.Postgres
	if mysqldsn.IsURL(url) {
		fromURL = sqlschema.MySQL
	}
	switch d := flagOrEnv(cmd.Flags(), "dialect", a.dialect, envDialect); d {
	case "":
		return fromURL, nil
	case string(sqlschema.Postgres), string(sqlschema.MySQL):
		if url != "" && sqlschema.Dialect(d) != fromURL {
			return "", usageErr("--dialect is %s but the database URL is %s's", d, fromURL)
		}
		return sqlschema.Dialect(d), nil
	default:
		return "", usageErr("--dialect is %q: postgres or mysql", d)
	}
}

// flagOrEnv is the flag's value when it was given on the command line, else
// the environment variable's.
func flagOrEnv(fs *pflag.FlagSet, name, value, env string) string {
	if fs.Changed(name) {
		return value
	}
	return os.Getenv(env)
}

// connect opens a pool to the database and checks that it answers within
// --connect-timeout. maxConns bounds the pool.
func (a *app) connect(ctx context.Context, cmd *cobra.Command, maxConns int32) (*pgxpool.Pool, error) {
	url := flagOrEnv(cmd.Flags(), "database-url", a.databaseURL, envDatabaseURL)
	if url == "" {
		return nil, usageErr("no database: set %s or --database-url", envDatabaseURL)
	}
	if a.connectTimeout <= 0 {
		return nil, usageErr("--connect-timeout must be positive")
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, usageErr("invalid database URL: %v", err)
	}
	cfg.MaxConns = maxConns
	if cfg.ConnConfig.ConnectTimeout == 0 || cfg.ConnConfig.ConnectTimeout > a.connectTimeout {
		cfg.ConnConfig.ConnectTimeout = a.connectTimeout
	}
	if cfg.ConnConfig.RuntimeParams["application_name"] == "" {
		cfg.ConnConfig.RuntimeParams["application_name"] = "exactlyonce-cli"
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("cannot connect to PostgreSQL: %w", err)
	}
	pctx, cancel := context.WithTimeout(ctx, a.connectTimeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		if ctx.Err() == nil && pctx.Err() != nil {
			return nil, fmt.Errorf("cannot connect to PostgreSQL at %s:%d: no answer within %s", cfg.ConnConfig.Host, cfg.ConnConfig.Port, a.connectTimeout)
		}
		return nil, fmt.Errorf("cannot connect to PostgreSQL: %w", err)
	}
	return pool, nil
}

// open connects and returns the DB with the names of the flags. When
// migrated is true it also checks that every migration of this version is
// applied, so that a command never half-works on old tables.
func (a *app) open(ctx context.Context, cmd *cobra.Command, maxConns int32, migrated bool) (sqlschema.DB, func(), error) {
	db, err := a.names(cmd)
	if err != nil {
		return db, nil, err
	}
	var closeDB func()
	if db.Dialect == sqlschema.MySQL {
		sdb, err := a.connectMySQL(ctx, cmd, int(maxConns))
		if err != nil {
			return db, nil, err
		}
		db.Conn, closeDB = wsql.BeginnerFromStdSQL(sdb), func() { _ = sdb.Close() }
	} else {
		pool, err := a.connect(ctx, cmd, maxConns)
		if err != nil {
			return db, nil, err
		}
		db.Conn, closeDB = wsql.BeginnerFromPgx(pool), pool.Close
	}
	if migrated {
		if err := requireMigrated(ctx, db); err != nil {
			closeDB()
			return db, nil, err
		}
	}
	return db, closeDB, nil
}

// connectMySQL opens a database/sql handle (go-sql-driver/mysql) to the
// mysql:// URL and checks that it answers within --connect-timeout.
func (a *app) connectMySQL(ctx context.Context, cmd *cobra.Command, maxConns int) (*stdsql.DB, error) {
	url := flagOrEnv(cmd.Flags(), "database-url", a.databaseURL, envDatabaseURL)
	if url == "" {
		return nil, usageErr("no database: set %s or --database-url", envDatabaseURL)
	}
	if a.connectTimeout <= 0 {
		return nil, usageErr("--connect-timeout must be positive")
	}
	dsn, err := mysqldsn.FromURL(url)
	if err != nil {
		return nil, usageErr("%v", err)
	}
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil {
		return nil, usageErr("invalid database URL: %v", err)
	}
	if cfg.Timeout == 0 || cfg.Timeout > a.connectTimeout {
		cfg.Timeout = a.connectTimeout
	}
	sdb, err := stdsql.Open("mysql", cfg.FormatDSN())
	if err != nil {
		return nil, fmt.Errorf("cannot connect to MySQL: %w", err)
	}
	sdb.SetMaxOpenConns(maxConns)
	pctx, cancel := context.WithTimeout(ctx, a.connectTimeout)
	defer cancel()
	if err := sdb.PingContext(pctx); err != nil {
		_ = sdb.Close()
		if ctx.Err() == nil && pctx.Err() != nil {
			return nil, fmt.Errorf("cannot connect to MySQL at %s: no answer within %s", cfg.Addr, a.connectTimeout)
		}
		return nil, fmt.Errorf("cannot connect to MySQL: %w", err)
	}
	return sdb, nil
}

// requireMigrated fails, naming the missing migrations and the command to
// run, unless every migration of this version is applied. When a table has
// no migration at all, it first looks for the library's tables elsewhere
// (tablesElsewhere): then the error names the flag to change instead.
func requireMigrated(ctx context.Context, db sqlschema.DB) error {
	st, err := sqlschema.Status(ctx, db)
	if err != nil {
		return opErr(ctx, db, "reading the migrations", err)
	}
	var missing []string
	applied := map[string]int{} // by target
	for _, m := range st {
		if m.Applied {
			applied[m.Target]++
		} else {
			missing = append(missing, m.Name)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	// A table none of whose migrations is recorded may be elsewhere: a
	// wrong --schema or table name, which 'migrate up' would not fix.
	if noInbox, noOutbox := applied["inbox"] == 0, applied["outbox"] == 0; noInbox || noOutbox {
		hint, nowhere, err := tablesElsewhere(ctx, db, noInbox, noOutbox)
		switch {
		case err != nil:
			return opErr(ctx, db, "looking for the tables in the catalog", err)
		case hint != nil:
			return hint
		case nowhere:
			return fmt.Errorf("no exactly-once tables in schema %q (inbox table %q, outbox table %q) nor in any other schema: run 'exactlyonce migrate up' with the same --schema, --inbox-table and --outbox-table",
				db.Schema, db.InboxTable, db.OutboxTable)
		}
	}
	if len(missing) == len(st) {
		return notMigrated(db, "no migration applied")
	}
	return notMigrated(db, fmt.Sprintf("%d of %d migrations missing (%s)", len(missing), len(st), strings.Join(missing, ", ")))
}

func notMigrated(db sqlschema.DB, detail string) error {
	return fmt.Errorf("tables not migrated in schema %q (inbox table %q, outbox table %q): %s: run 'exactlyonce migrate up' with the same --schema, --inbox-table and --outbox-table",
		db.Schema, db.InboxTable, db.OutboxTable, detail)
}

// opErr turns the error of an operation into the CLI's message: the
// not-migrated hint in CLI terms, the timeout said plainly.
func opErr(ctx context.Context, db sqlschema.DB, what string, err error) error {
	switch {
	case errors.Is(err, sqlschema.ErrNotMigrated):
		return notMigrated(db, "a table or column is missing")
	case errors.Is(ctx.Err(), context.DeadlineExceeded):
		return fmt.Errorf("%s: timed out (--timeout): %w", what, err)
	case ctx.Err() != nil:
		return fmt.Errorf("%s: interrupted: %w", what, err)
	}
	return fmt.Errorf("%s: %w", what, err)
}

// printJSON writes v as one indented JSON document.
func (a *app) printJSON(v any) error {
	enc := json.NewEncoder(a.stdout)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(v)
}

// requireArg returns the single positional argument, or a usage error when
// it is missing or empty.
func requireArg(args []string, name string) (string, error) {
	if len(args) != 1 {
		return "", usageErr("expected exactly one %s argument, got %d", name, len(args))
	}
	if args[0] == "" {
		return "", usageErr("%s must not be empty", name)
	}
	return args[0], nil
}
