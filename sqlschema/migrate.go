package sqlschema

import (
	"bytes"
	"context"
	stdsql "database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"sort"
	"strconv"
	"strings"
	"text/template"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlfile"
)

// migrationFiles are the migrations, one directory per dialect
// (migrations/postgres, migrations/mysql).
//
//go:embed migrations/postgres/*.up.sql migrations/mysql/*.up.sql
var migrationFiles embed.FS

// advisoryLockKey serialises concurrent Migrate calls in one database. It is
// a fixed, arbitrary 64-bit number ("eo-migr" in ASCII).
const advisoryLockKey int64 = 0x656f2d6d696772

// mysqlLockName is advisoryLockKey's MySQL counterpart: the name of the
// session-level lock (GET_LOCK) that serialises Migrate calls on one server.
const mysqlLockName = "watermill_exactlyonce_migrate"

// migration is one numbered, embedded up-migration with its SQL rendered for
// a DB's names.
type migration struct {
	// Target is "inbox" or "outbox": each table has its own version line.
	Target string
	// Version starts at 1 and increases by one per migration of a target.
	Version int
	// Name is the file name it was embedded from.
	Name string
	// SQL is the rendered statement text, with quoted schema-qualified names.
	SQL string
}

// migrations returns every migration rendered for cfg, inbox first, each
// target in version order.
func migrations(cfg DB) ([]migration, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.WithDefaults()

	dir := "migrations/" + cfg.Dialect.String()
	entries, err := fs.ReadDir(migrationFiles, dir)
	if err != nil {
		return nil, fmt.Errorf("sqlschema: reading embedded migrations: %w", err)
	}
	data := templateData{cfg: cfg}
	var out []migration
	for _, e := range entries {
		target, version, err := parseMigrationName(e.Name())
		if err != nil {
			return nil, err
		}
		text, err := migrationFiles.ReadFile(dir + "/" + e.Name())
		if err != nil {
			return nil, fmt.Errorf("sqlschema: reading %s: %w", e.Name(), err)
		}
		tmpl, err := template.New(e.Name()).Option("missingkey=error").Parse(string(text))
		if err != nil {
			return nil, fmt.Errorf("sqlschema: parsing %s: %w", e.Name(), err)
		}
		var buf bytes.Buffer
		if err := tmpl.Execute(&buf, data); err != nil {
			return nil, fmt.Errorf("sqlschema: rendering %s: %w", e.Name(), err)
		}
		out = append(out, migration{Target: target, Version: version, Name: e.Name(), SQL: buf.String()})
	}
	sort.SliceStable(out, func(i, j int) bool {
		if out[i].Target != out[j].Target {
			return out[i].Target == "inbox"
		}
		return out[i].Version < out[j].Version
	})
	return out, nil
}

// SQL returns the whole schema for db's names as one script: CREATE SCHEMA
// followed by every migration, each headed by a comment with its name and
// version. Use it with migration tools other than Migrate (goose,
// golang-migrate, atlas); it is idempotent (IF NOT EXISTS everywhere) but
// records no versions, so Check cannot see it: run Migrate once afterwards,
// or keep using your tool. db.Conn is not used.
func SQL(db DB) (string, error) {
	cfg := db
	migs, err := migrations(cfg)
	if err != nil {
		return "", err
	}
	cfg = cfg.WithDefaults()
	st, err := cfg.bookkeeping()
	if err != nil {
		return "", err
	}
	var b strings.Builder
	if cfg.Schema != "" {
		b.WriteString(st.Get("CreateSchema") + "\n")
	}
	for _, m := range migs {
		fmt.Fprintf(&b, "\n-- %s (target %s, version %d)\n%s", m.Name, m.Target, m.Version, m.SQL)
	}
	return b.String(), nil
}

// Migrate brings the tables of db up to date: it creates the schema if
// missing and applies, in one transaction, every migration not yet recorded
// in the migrations table. It is idempotent, and safe when several processes
// run it at once: a transaction-scoped advisory lock serialises them, and the
// later ones find the work done. Its transaction is READ COMMITTED whatever
// default isolation the role or database has.
//
// db.Conn is required. Migrate never runs inside a caller's transaction.
func Migrate(ctx context.Context, db DB) (err error) {
	if err := db.validateConn(); err != nil {
		return fmt.Errorf("sqlschema: Migrate: %w", err)
	}
	cfg := db
	migs, err := migrations(cfg)
	if err != nil {
		return err
	}
	cfg = cfg.WithDefaults()
	st, err := cfg.bookkeeping()
	if err != nil {
		return err
	}
	if cfg.Dialect == MySQL {
		return migrateMySQL(ctx, cfg, st, migs)
	}

	// READ COMMITTED whatever the role's or database's default: each
	// statement after the advisory lock must see what the previous holder
	// committed (under REPEATABLE READ the snapshot predates the lock wait).
	tx, err := db.Conn.BeginTx(ctx, &stdsql.TxOptions{Isolation: stdsql.LevelReadCommitted})
	if err != nil {
		return fmt.Errorf("sqlschema: Migrate: begin transaction: %w", err)
	}
	defer func() {
		if err != nil {
			_ = tx.Rollback()
		}
	}()

	if _, err = tx.ExecContext(ctx, st.Get("MigrateLock")); err != nil {
		return fmt.Errorf("sqlschema: Migrate: advisory lock: %w", err)
	}
	if _, err = tx.ExecContext(ctx, st.Get("CreateMigrationsTable")); err != nil {
		return fmt.Errorf("sqlschema: Migrate: creating %s: %w", cfg.migrations(), err)
	}

	applied, err := appliedMigrations(ctx, tx, st, cfg, migs)
	if err != nil {
		return fmt.Errorf("sqlschema: Migrate: %w", err)
	}

	for _, m := range migs {
		target := cfg.targetName(m.Target)
		if _, ok := applied[target+":"+strconv.Itoa(m.Version)]; ok {
			continue
		}
		if _, err = tx.ExecContext(ctx, m.SQL); err != nil {
			return fmt.Errorf("sqlschema: Migrate: applying %s to %s: %w", m.Name, target, err)
		}
		if _, err = tx.ExecContext(ctx, st.Get("RecordMigration"), target, m.Version, m.Name); err != nil {
			return fmt.Errorf("sqlschema: Migrate: recording %s: %w", m.Name, err)
		}
	}
	if err = checkLayout(ctx, tx, st, cfg); err != nil {
		return fmt.Errorf("sqlschema: Migrate: %w", err)
	}
	if layout, ok := cfg.partitionLayout(); ok {
		if err = ensureClaimFunctions(ctx, tx, st, cfg, migs); err != nil {
			return fmt.Errorf("sqlschema: Migrate: %w", err)
		}
		if _, err = layout.Ensure(ctx, tx); err != nil {
			return fmt.Errorf("sqlschema: Migrate: %w", err)
		}
	}
	if err = tx.Commit(); err != nil {
		return fmt.Errorf("sqlschema: Migrate: commit: %w", err)
	}
	return nil
}

// claimFunctionsMigration creates the partitioned layout's claim functions
// (<table>_claim, <table>_claim_batch, <table>_duplicate).
const claimFunctionsMigration = "inbox_002_partitioned_claim_functions.up.sql"

// ensureClaimFunctions creates the partitioned layout's claim functions
// when they are missing although their migration was recorded for this
// table name: a partitioned table renamed into place (docs/retention.md,
// moving an existing table), whose functions were created under its former
// name (and name that table in their bodies), or a table dropped and
// created again. The migration is idempotent (CREATE OR REPLACE).
func ensureClaimFunctions(ctx context.Context, tx wsql.ContextExecutor, st sqlfile.Statements, cfg DB, migs []migration) error {
	var missing bool
	fn := templateData{cfg: cfg}.InboxFunction
	if err := seam.QueryRow(ctx, tx, st.Get("ClaimFunctionsMissing"),
		[]any{fn("claim") + "(text, text, boolean)", fn("claim_batch") + "(text, text[])", fn("duplicate") + "(text, text)"}, &missing); err != nil {
		return fmt.Errorf("looking for the claim functions: %w", err)
	}
	if !missing {
		return nil
	}
	i := slices.IndexFunc(migs, func(m migration) bool { return m.Target == "inbox" && m.Name == claimFunctionsMigration })
	if i < 0 {
		return errors.New("the migration " + claimFunctionsMigration + " is missing")
	}
	if _, err := tx.ExecContext(ctx, migs[i].SQL); err != nil {
		return fmt.Errorf("creating the claim functions (%s): %w", claimFunctionsMigration, err)
	}
	return nil
}

// partitionLayout is the partition manager's view of a partitioned inbox
// (c with its defaults); ok is false for the plain layout.
func (c DB) partitionLayout() (inboxpart.Layout, bool) {
	if c.Partitions == nil {
		return inboxpart.Layout{}, false
	}
	p := c.Partitions.WithDefaults()
	return inboxpart.Layout{Schema: c.Schema, Table: c.InboxTable, Hourly: p.Interval == Hourly, Ahead: p.Ahead}, true
}

// targetName keys the migrations table by table, so that several inbox or
// outbox tables can live in one schema with their own version lines.
func (c DB) targetName(target string) string {
	if target == "inbox" {
		return "inbox:" + c.InboxTable
	}
	return "outbox:" + c.OutboxTable
}

func parseMigrationName(name string) (target string, version int, err error) {
	// <target>_<version>_<description>.up.sql
	parts := strings.SplitN(strings.TrimSuffix(name, ".up.sql"), "_", 3)
	if len(parts) < 2 || (parts[0] != "inbox" && parts[0] != "outbox") {
		return "", 0, fmt.Errorf("sqlschema: bad embedded migration name %q", name)
	}
	version, err = strconv.Atoi(parts[1])
	if err != nil || version < 1 {
		return "", 0, fmt.Errorf("sqlschema: bad version in embedded migration name %q", name)
	}
	return parts[0], version, nil
}

// templateData is what migration templates see.
type templateData struct{ cfg DB }

// Partitioned is true for the time-partitioned inbox layout (DB.Partitions).
func (d templateData) Partitioned() bool { return d.cfg.Partitions != nil }

func (d templateData) Inbox() string { return d.cfg.Inbox() }

// InboxParked is the table of parked messages: the inbox table's name with
// "_parked", schema-qualified.
func (d templateData) InboxParked() string {
	return d.cfg.Dialect.QuoteIdentifier(d.cfg.Schema, d.cfg.InboxTable+"_parked")
}
func (d templateData) Outbox() string { return d.cfg.Outbox() }

// InboxIndex names an index of the inbox table (unqualified: PostgreSQL
// creates an index in its table's schema).
func (d templateData) InboxIndex(suffix string) string {
	return d.cfg.Dialect.QuoteIdentifier(d.cfg.InboxTable + "_" + suffix)
}

// InboxFunction names a function that belongs to the inbox table,
// schema-qualified (<table>_<suffix>, in the table's schema).
func (d templateData) InboxFunction(suffix string) string {
	return pgx.Identifier{d.cfg.Schema, d.cfg.InboxTable + "_" + suffix}.Sanitize()
}

// LockKey is the SQL expression of the advisory lock key of (consumer, key)
// of the partitioned inbox, as every claim takes it (inboxpart.LockKey).
func (d templateData) LockKey(consumer, key string) string {
	return inboxpart.LockKey(d.cfg.Inbox(), consumer, key)
}

// IsolationMarker and DuplicateMarker start the messages of the errors the
// partitioned layout's claim functions raise (inboxpart).
func (d templateData) IsolationMarker() string { return inboxpart.IsolationMarker }
func (d templateData) DuplicateMarker() string { return inboxpart.DuplicateMarker }

// OutboxIndex names an index of the outbox table.
func (d templateData) OutboxIndex(suffix string) string {
	return d.cfg.Dialect.QuoteIdentifier(d.cfg.OutboxTable + "_" + suffix)
}

// OutboxKeyLocks is the MySQL outbox's table of ordering-key locks: the
// outbox table's name with "_key_locks", schema-qualified.
func (d templateData) OutboxKeyLocks() string {
	return d.cfg.Dialect.QuoteIdentifier(d.cfg.Schema, d.cfg.OutboxTable+"_key_locks")
}

// appliedMigrations reads what db's migrations table records for db's
// tables: target:version -> when it was applied. A record is known by its
// file name, not its number alone: a record whose name is not this
// version's file of that number, or whose number this version has no file
// for, was made by a development build from before v0.1.0 (whose
// migrations were folded into one per table) or by another version of the
// library. Those tables do not have the shape this version expects, and
// migrating them in place is not supported: the error says to drop them
// and migrate again.
func appliedMigrations(ctx context.Context, q wsql.ContextExecutor, st sqlfile.Statements, db DB, migs []migration) (map[string]time.Time, error) {
	ours := map[string]string{} // target:version -> file name
	targets := map[string]bool{}
	for _, m := range migs {
		t := db.targetName(m.Target)
		ours[t+":"+strconv.Itoa(m.Version)] = m.Name
		targets[t] = true
	}
	rows, err := q.QueryContext(ctx, st.Get("AppliedMigrations"))
	if err != nil {
		return nil, fmt.Errorf("reading applied migrations: %w", err)
	}
	applied := map[string]time.Time{}
	var foreign []string
	for rows.Next() {
		var target, name string
		var version int
		var at time.Time
		if err := rows.Scan(&target, &version, &name, &at); err != nil {
			_ = rows.Close()
			return nil, fmt.Errorf("reading applied migrations: %w", err)
		}
		if !targets[target] {
			continue // another table set's record
		}
		key := target + ":" + strconv.Itoa(version)
		if ours[key] != name {
			foreign = append(foreign, name)
			continue
		}
		applied[key] = at
	}
	if err := seam.Close(rows); err != nil {
		return nil, fmt.Errorf("reading applied migrations: %w", err)
	}
	if len(foreign) > 0 {
		sort.Strings(foreign)
		return nil, fmt.Errorf("%w: %s records migrations this version of the library does not have (%s)",
			ErrNotMigrated, db.migrations(), strings.Join(foreign, ", "))
	}
	return applied, nil
}
