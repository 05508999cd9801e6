// Package inboxpart manages the partitions of a time-partitioned inbox table
// (sqlschema.DB.Partitions): their names and bounds, creating them ahead,
// and listing them. It is shared by sqlschema (Migrate creates the first
// ones) and inboxdb (claims, maintenance, retention), and imports neither.
//
// A partition covers one interval [From, To) of partition_at, aligned in
// UTC, and is named <table>_pYYYYMMDD (daily) or <table>_pYYYYMMDDHH
// (hourly), in the inbox table's schema. Partitions are created as plain
// tables and then attached (ATTACH PARTITION takes a SHARE UPDATE EXCLUSIVE
// lock on the inbox table, which does not conflict with claims; CREATE
// TABLE ... PARTITION OF would take an ACCESS EXCLUSIVE one). There is no
// DEFAULT partition: with one, attaching and detaching would lock it (and
// through it every claim, which reads every partition) in ACCESS EXCLUSIVE
// mode, and DETACH ... CONCURRENTLY would be refused.
//
// Its statements are in queries/postgres/partitions.sql, rendered with the
// layout by the call that runs them (List, Ensure: maintenance, at most a
// few calls a minute); CreatePartition and AttachPartition are run-time
// templates (sqlexec.Template), filled with the partition's name and
// bounds.
//
// It is not folded into inboxdb: sqlschema (Migrate creates the first
// partitions, and its migrations need LockKey) must not import inboxdb.
// The lock plan that every writer obeys is inboxdb's lockPlan; this
// package's maintenance lock is its step 5.
package inboxpart

import (
	"context"
	"embed"
	"fmt"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlexec"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlfile"
)

//go:embed queries
var queryFiles embed.FS

// queryData is what partitions.sql sees.
type queryData struct {
	Parent               string
	MaintenanceLockClass int
}

// Run marks a run-time hole (sqlexec.Hole).
func (queryData) Run(name string) string { return sqlexec.Hole(name) }

// Statements returns l's statements, by name (partitions.sql), rendered
// for l; the run-time templates keep their holes.
func (l Layout) Statements() (sqlfile.Statements, error) {
	st, err := sqlfile.Render(queryFiles, "queries/postgres", queryData{Parent: l.Parent(), MaintenanceLockClass: MaintenanceLockClass})
	if err != nil {
		return sqlfile.Statements{}, fmt.Errorf("inboxpart: %w", err)
	}
	return st, nil
}

// Layout is one partitioned inbox table.
type Layout struct {
	Schema, Table string
	// Hourly selects hourly partitions; otherwise daily.
	Hourly bool
	// Ahead is how many intervals after the current one are created ahead.
	Ahead int
}

// Step is the length of one partition's interval.
func (l Layout) Step() time.Duration {
	if l.Hourly {
		return time.Hour
	}
	return 24 * time.Hour
}

// Parent is the quoted, schema-qualified inbox table.
func (l Layout) Parent() string { return pgx.Identifier{l.Schema, l.Table}.Sanitize() }

func (l Layout) nameFormat() string {
	if l.Hourly {
		return "2006010215"
	}
	return "20060102"
}

// Floor returns the start of the interval holding t.
func (l Layout) Floor(t time.Time) time.Time { return t.UTC().Truncate(l.Step()) }

// Name is the unqualified name of the partition starting at from.
func (l Layout) Name(from time.Time) string {
	return l.Table + "_p" + from.UTC().Format(l.nameFormat())
}

// Quoted is the quoted, schema-qualified name of a partition.
func (l Layout) Quoted(name string) string { return pgx.Identifier{l.Schema, name}.Sanitize() }

// Partition is one partition of the table.
type Partition struct {
	Name     string
	From, To time.Time
	// DetachPending is true when a DETACH ... CONCURRENTLY of it was
	// interrupted: it must be finalized (Finalize) before anything else.
	DetachPending bool
}

// parse reads a partition's bounds from its name; ok is false for a
// partition this package did not name (it is left alone).
func (l Layout) parse(name string) (Partition, bool) {
	prefix := l.Table + "_p"
	if !strings.HasPrefix(name, prefix) || len(name) != len(prefix)+len(l.nameFormat()) {
		return Partition{}, false
	}
	from, err := time.ParseInLocation(l.nameFormat(), name[len(prefix):], time.UTC)
	if err != nil {
		return Partition{}, false
	}
	return Partition{Name: name, From: from, To: from.Add(l.Step())}, true
}

// List returns the table's partitions named by this package, oldest first.
func (l Layout) List(ctx context.Context, db wsql.ContextExecutor) ([]Partition, error) {
	st, err := l.Statements()
	if err != nil {
		return nil, err
	}
	rows, err := db.QueryContext(ctx, st.Get("List"), l.Parent())
	if err != nil {
		return nil, fmt.Errorf("listing the partitions of %s: %w", l.Parent(), err)
	}
	var out []Partition
	for rows.Next() {
		var name string
		var pending bool
		if err := rows.Scan(&name, &pending); err != nil {
			_ = rows.Close()
			return nil, fmt.Errorf("listing the partitions of %s: %w", l.Parent(), err)
		}
		if p, ok := l.parse(name); ok {
			p.DetachPending = pending
			out = append(out, p)
		}
	}
	if err := seam.Close(rows); err != nil {
		return nil, fmt.Errorf("listing the partitions of %s: %w", l.Parent(), err)
	}
	return out, nil
}

// MaintenanceLockClass is the first key of the maintenance lock, which
// serialises Ensure calls on one table (two would race on CREATE TABLE and
// ATTACH): a transaction-scoped advisory lock in the two-key space (the
// claims' per-key locks use the one-key space); the second key is a hash
// of the table's name.
const MaintenanceLockClass = 0x656f706d // "eopm"

// Ensure creates and attaches the partitions, missing among the current
// interval and Ahead intervals after it, by the database's clock. db must
// be a transaction (the advisory lock that serialises maintenance is
// transaction-scoped, and the created tables are attached atomically); the
// caller commits. It returns the names created.
func (l Layout) Ensure(ctx context.Context, tx wsql.ContextExecutor) ([]string, error) {
	st, err := l.Statements()
	if err != nil {
		return nil, err
	}
	create, err := sqlexec.NewTemplate(st.Get("CreatePartition"), "Partition")
	if err != nil {
		return nil, fmt.Errorf("inboxpart: CreatePartition: %w", err)
	}
	attach, err := sqlexec.NewTemplate(st.Get("AttachPartition"), "Partition", "From", "To")
	if err != nil {
		return nil, fmt.Errorf("inboxpart: AttachPartition: %w", err)
	}
	if _, err := tx.ExecContext(ctx, st.Get("MaintenanceLock")); err != nil {
		return nil, fmt.Errorf("partition maintenance lock: %w", err)
	}
	var now time.Time
	if err := seam.QueryRow(ctx, tx, st.Get("Now"), nil, &now); err != nil {
		return nil, err
	}
	have, err := l.List(ctx, tx)
	if err != nil {
		return nil, err
	}
	exists := map[string]bool{}
	for _, p := range have {
		exists[p.Name] = true
	}
	var created []string
	from := l.Floor(now)
	for i := 0; i <= l.Ahead; i++ {
		lo := from.Add(time.Duration(i) * l.Step())
		name := l.Name(lo)
		if exists[name] {
			continue
		}
		q := l.Quoted(name)
		// A plain table, then ATTACH: see the package comment for the locks.
		if _, err := tx.ExecContext(ctx, create.Fill(q)); err != nil {
			return created, fmt.Errorf("creating partition %s: %w", q, err)
		}
		if _, err := tx.ExecContext(ctx, attach.Fill(q, Literal(lo), Literal(lo.Add(l.Step())))); err != nil {
			return created, fmt.Errorf("attaching partition %s: %w", q, err)
		}
		created = append(created, name)
	}
	return created, nil
}

// Literal is t as a timestamptz SQL literal, independent of the session's
// TimeZone.
func Literal(t time.Time) string {
	return "'" + t.UTC().Format("2006-01-02 15:04:05.999999") + "+00'::timestamptz"
}

// LockKey is the SQL expression of the advisory lock key of (consumer, key)
// in the partitioned inbox table (quoted, schema-qualified, as
// sqlschema.DB.Inbox returns it), given as SQL expressions of type text: a
// 64-bit hash of the table, the consumer and the key, unambiguous because
// the consumer's length comes first. Every statement that may create a
// record of a key takes this lock first: the claims built by inboxdb and
// the claim functions a migration creates (sqlschema) share this one
// definition, so that they exclude each other.
func LockKey(table, consumer, key string) string {
	return `hashtextextended('` + table + `/' || length(` + consumer + `)::text || '/' || ` + consumer + ` || '/' || ` + key + `, 0)`
}

// IsolationMarker starts the text of the error a claim on the partitioned
// layout raises outside READ COMMITTED (inboxdb turns it into
// ErrNeedsReadCommitted); the isolation level follows it.
const IsolationMarker = "watermill-exactlyonce: the partitioned inbox needs READ COMMITTED; this transaction is"

// DuplicateMarker is the text of the error the raising claim function
// (sqlschema's <table>_claim with raise true) raises, with SQLSTATE 23505,
// when the key already has a record: the pgx fast path's BEGIN query then
// fails, as the plain layout's INSERT does for a duplicate.
const DuplicateMarker = "watermill-exactlyonce: the key already has a record"
