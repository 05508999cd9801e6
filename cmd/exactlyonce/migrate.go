package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/spf13/cobra"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func (a *app) migrateCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Create or update the tables (up), print their SQL (sql), list migrations (status)",
		Args:  cobra.ArbitraryArgs,
		RunE:  groupRunE,
	}
	cmd.AddCommand(
		&cobra.Command{
			Use:   "up",
			Short: "Apply every migration not applied yet (idempotent, safe to run from several places at once)",
			Args:  cobra.NoArgs,
			RunE:  a.migrateUp,
		},
		&cobra.Command{
			Use:   "sql",
			Short: "Print the whole schema as one SQL script, for your own migration tool (needs no database)",
			Args:  cobra.NoArgs,
			RunE:  a.migrateSQL,
		},
		&cobra.Command{
			Use:   "status",
			Short: "List the migrations of this version and whether the database has them",
			Args:  cobra.NoArgs,
			RunE:  a.migrateStatus,
		},
	)
	return cmd
}

// migrationJSON is one migration in --json output.
type migrationJSON struct {
	Target    string  `json:"target"`
	Table     string  `json:"table"`
	Version   int     `json:"version"`
	Name      string  `json:"name"`
	Applied   bool    `json:"applied"`
	AppliedAt *string `json:"applied_at"`
}

type tablesJSON struct {
	Schema      string `json:"schema"`
	InboxTable  string `json:"inbox_table"`
	OutboxTable string `json:"outbox_table"`
}

func tablesOf(db sqlschema.DB) tablesJSON {
	return tablesJSON{Schema: db.Schema, InboxTable: db.InboxTable, OutboxTable: db.OutboxTable}
}

func (a *app) migrateUp(cmd *cobra.Command, _ []string) error {
	ctx, cancel := a.opContext(cmd, false)
	defer cancel()
	db, closeDB, err := a.open(ctx, cmd, 2, false)
	if err != nil {
		return err
	}
	defer closeDB()
	before, err := sqlschema.Status(ctx, db)
	if err != nil {
		return opErr(ctx, db, "reading the migrations", err)
	}
	if err := sqlschema.Migrate(ctx, db); err != nil {
		return opErr(ctx, db, "migrating", err)
	}
	var applied []string
	for _, m := range before {
		if !m.Applied {
			applied = append(applied, m.Name)
		}
	}
	if a.jsonOut {
		return a.printJSON(struct {
			tablesJSON
			Applied []string `json:"applied"`
			Total   int      `json:"total"`
		}{tablesOf(db), nonNil(applied), len(before)})
	}
	if len(applied) == 0 {
		_, err := fmt.Fprintf(a.stdout, "Already up to date: %s (%d migrations).\n", describeTables(db), len(before))
		return err
	}
	fmt.Fprintf(a.stdout, "Applied %d migrations to %s:\n", len(applied), describeTables(db))
	for _, n := range applied {
		fmt.Fprintf(a.stdout, "  %s\n", n)
	}
	return nil
}

func (a *app) migrateSQL(cmd *cobra.Command, _ []string) error {
	db, err := a.names(cmd)
	if err != nil {
		return err
	}
	script, err := sqlschema.SQL(db)
	if err != nil {
		return err
	}
	if a.jsonOut {
		return a.printJSON(struct {
			tablesJSON
			SQL string `json:"sql"`
		}{tablesOf(db), script})
	}
	_, err = io.WriteString(a.stdout, script)
	return err
}

func (a *app) migrateStatus(cmd *cobra.Command, _ []string) error {
	ctx, cancel := a.opContext(cmd, false)
	defer cancel()
	db, closeDB, err := a.open(ctx, cmd, 2, false)
	if err != nil {
		return err
	}
	defer closeDB()
	st, err := sqlschema.Status(ctx, db)
	if err != nil {
		return opErr(ctx, db, "reading the migrations", err)
	}
	pending := 0
	for _, m := range st {
		if !m.Applied {
			pending++
		}
	}
	if a.jsonOut {
		ms := make([]migrationJSON, len(st))
		for i, m := range st {
			ms[i] = migrationJSON{Target: m.Target, Table: m.Table, Version: m.Version, Name: m.Name, Applied: m.Applied, AppliedAt: jsonTime(m.AppliedAt)}
		}
		return a.printJSON(struct {
			tablesJSON
			UpToDate   bool            `json:"up_to_date"`
			Pending    int             `json:"pending"`
			Migrations []migrationJSON `json:"migrations"`
		}{tablesOf(db), pending == 0, pending, ms})
	}
	fmt.Fprintf(a.stdout, "%s\n\n", upperFirst(describeTables(db)))
	tw := newTable(a.stdout)
	fmt.Fprintln(tw, "TABLE\tVERSION\tMIGRATION\tAPPLIED")
	for _, m := range st {
		applied := "pending"
		if m.AppliedAt != nil {
			applied = fmtTime(*m.AppliedAt)
		}
		fmt.Fprintf(tw, "%s %s\t%d\t%s\t%s\n", m.Target, m.Table, m.Version, m.Name, applied)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if pending == 0 {
		_, err = fmt.Fprintf(a.stdout, "\nUp to date (%d migrations).\n", len(st))
	} else {
		_, err = fmt.Fprintf(a.stdout, "\n%d of %d migrations pending: run 'exactlyonce migrate up'.\n", pending, len(st))
	}
	return err
}

func describeTables(db sqlschema.DB) string {
	return fmt.Sprintf("schema %q (inbox table %q, outbox table %q)", db.Schema, db.InboxTable, db.OutboxTable)
}

func upperFirst(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// nonNil makes an empty list a JSON [] rather than null.
func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}
