package main

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// When the tables the flags name are missing, the advice to run 'migrate
// up' is right only if they are missing from the whole database: with a
// wrong --schema (or --inbox-table, --outbox-table) it creates empty
// tables in the wrong place, where every command then finds nothing. So
// the catalog is searched first for the library's tables, in the schema
// under other names and in the other schemas.

// schemaTables are the library's tables found in one schema.
type schemaTables struct {
	schema        string
	inbox, outbox []string // table names, sorted
}

// libraryTablesSQL finds the library's tables in every schema the user may
// use, from the catalog alone (no table is read, so a schema dropped
// meanwhile or a table the user may not read is no error): a table with
// the inbox's (or the outbox's) first columns, in a schema that holds the
// library's migrations table, or that also has the column lease_token
// (quarantined_at), which a table of the user's of that shape is unlikely
// to have (tables created with 'migrate sql' and another tool record no
// migrations). A partition of a partitioned inbox is not a table of its
// own. The inbox's table of parked messages has neither shape.
const libraryTablesSQL = `
SELECT schema, name, inbox
FROM (
    SELECT n.nspname::text AS schema, c.relname::text AS name,
           count(*) FILTER (WHERE a.attname IN ('consumer', 'message_key', 'status', 'attempts', 'first_seen_at', 'processed_at')) = 6 AS inbox,
           count(*) FILTER (WHERE a.attname IN ('id', 'topic', 'uuid', 'payload', 'metadata', 'created_at')) = 6 AS outbox,
           bool_or(a.attname = 'lease_token') AS inbox_later,
           bool_or(a.attname = 'quarantined_at') AS outbox_later,
           EXISTS (SELECT 1 FROM pg_catalog.pg_class m
                   WHERE m.relnamespace = n.oid AND m.relname = '` + migrationsTable + `' AND m.relkind IN ('r', 'p')) AS versioned
    FROM pg_catalog.pg_class c
    JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
    JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attnum > 0 AND NOT a.attisdropped
    WHERE c.relkind IN ('r', 'p') AND NOT c.relispartition
      AND n.nspname !~ '^pg_' AND n.nspname <> 'information_schema'
      AND has_schema_privilege(n.oid, 'USAGE')
      AND a.attname IN ('consumer', 'message_key', 'status', 'attempts', 'first_seen_at', 'processed_at', 'lease_token',
                        'id', 'topic', 'uuid', 'payload', 'metadata', 'created_at', 'quarantined_at')
    GROUP BY n.oid, n.nspname, c.relname
) t
WHERE (inbox AND (inbox_later OR versioned)) OR (outbox AND (outbox_later OR versioned))
ORDER BY schema, name`

// migrationsTable is the table in which sqlschema.Migrate records the
// migrations it applied, in DB.Schema (sqlschema's migrationsTable).
const migrationsTable = "watermill_exactlyonce_migrations"

// libraryTables returns the library's tables of every schema, by schema.
func libraryTables(ctx context.Context, q wsql.ContextExecutor) ([]schemaTables, error) {
	rows, err := q.QueryContext(ctx, libraryTablesSQL)
	if err != nil {
		return nil, err
	}
	var out []schemaTables
	for rows.Next() {
		var schema, name string
		var isInbox bool
		if err := rows.Scan(&schema, &name, &isInbox); err != nil {
			_ = rows.Close()
			return nil, err
		}
		if len(out) == 0 || out[len(out)-1].schema != schema {
			out = append(out, schemaTables{schema: schema})
		}
		st := &out[len(out)-1]
		if isInbox {
			st.inbox = append(st.inbox, name)
		} else {
			st.outbox = append(st.outbox, name)
		}
	}
	return out, seam.Close(rows)
}

// tablesElsewhere is called when no migration of db's inbox table
// (noInbox) or of its outbox table (noOutbox) is recorded. It returns the
// error that says where the library's tables are when the catalog shows
// that a flag is wrong, and nil when 'migrate up' is the right advice: a
// missing table is nowhere else in the schema, and with both missing,
// nowhere in the database (then nowhere is true); or the tables are there
// and were created without recording migrations ('migrate sql').
func tablesElsewhere(ctx context.Context, db sqlschema.DB, noInbox, noOutbox bool) (hint error, nowhere bool, err error) {
	found, err := libraryTables(ctx, db.Conn)
	if err != nil {
		return nil, false, err
	}
	var here schemaTables
	var others []schemaTables
	for _, st := range found {
		if st.schema == db.Schema {
			here = st
		} else {
			others = append(others, st)
		}
	}
	absentInbox := noInbox && !slices.Contains(here.inbox, db.InboxTable)
	absentOutbox := noOutbox && !slices.Contains(here.outbox, db.OutboxTable)
	if !absentInbox && !absentOutbox {
		return nil, false, nil // there, without recorded migrations
	}

	// The schema holds the library's tables under other names.
	if (absentInbox && len(here.inbox) > 0) || (absentOutbox && len(here.outbox) > 0) {
		var missing, seen []string
		var adv advice
		if absentInbox {
			missing = append(missing, fmt.Sprintf("inbox table %q", db.InboxTable))
			if len(here.inbox) > 0 {
				seen = append(seen, tableList("inbox", here.inbox))
				adv.table("--inbox-table", here.inbox)
			}
		}
		if absentOutbox {
			missing = append(missing, fmt.Sprintf("outbox table %q", db.OutboxTable))
			if len(here.outbox) > 0 {
				seen = append(seen, tableList("outbox", here.outbox))
				adv.table("--outbox-table", here.outbox)
			}
		}
		return fmt.Errorf("no %s in schema %q; found %s there: %s",
			strings.Join(missing, " nor "), db.Schema, strings.Join(seen, ", "), adv), false, nil
	}
	if !absentInbox || !absentOutbox {
		// One of the two is in the schema: the other belongs there too.
		return nil, false, nil
	}
	if len(others) == 0 {
		return nil, true, nil
	}

	// Other schemas hold them: those with the tables asked for first.
	score := func(st schemaTables) int {
		n := 0
		if slices.Contains(st.inbox, db.InboxTable) {
			n++
		}
		if slices.Contains(st.outbox, db.OutboxTable) {
			n++
		}
		return n
	}
	slices.SortStableFunc(others, func(a, b schemaTables) int {
		return cmp.Or(cmp.Compare(score(b), score(a)), strings.Compare(a.schema, b.schema))
	})
	if len(others) == 1 {
		st := others[0]
		adv := advice{concrete: []string{"--schema " + st.schema}}
		if len(st.inbox) > 0 && !slices.Contains(st.inbox, db.InboxTable) {
			adv.table("--inbox-table", st.inbox)
		}
		if len(st.outbox) > 0 && !slices.Contains(st.outbox, db.OutboxTable) {
			adv.table("--outbox-table", st.outbox)
		}
		return fmt.Errorf("no exactly-once tables in schema %q; found them in schema %q (%s): %s",
			db.Schema, st.schema, describe(st), adv), false, nil
	}
	// Several: grouped by their table names (the groups in the order of
	// their best schema), at most 5 schemas a group and 3 groups.
	const perGroup, groups = 5, 3
	type group struct {
		tables  string
		schemas []string
	}
	var gs []*group
	byTables := map[string]*group{}
	for _, st := range others {
		d := describe(st)
		g := byTables[d]
		if g == nil {
			g = &group{tables: d}
			byTables[d] = g
			gs = append(gs, g)
		}
		g.schemas = append(g.schemas, st.schema)
	}
	var parts []string
	var hidden int
	otherInbox, otherOutbox := false, false
	for i, g := range gs {
		if i >= groups {
			hidden += len(g.schemas)
			continue
		}
		st := others[slices.IndexFunc(others, func(st schemaTables) bool { return st.schema == g.schemas[0] })]
		otherInbox = otherInbox || !slices.Contains(st.inbox, db.InboxTable)
		otherOutbox = otherOutbox || !slices.Contains(st.outbox, db.OutboxTable)
		quoted := make([]string, 0, perGroup)
		for _, name := range g.schemas[:min(len(g.schemas), perGroup)] {
			quoted = append(quoted, fmt.Sprintf("%q", name))
		}
		list := joinAnd(quoted)
		if n := len(g.schemas) - perGroup; n > 0 {
			list = strings.Join(quoted, ", ") + fmt.Sprintf(" and %d more", n)
		}
		word := "schema "
		if len(g.schemas) > 1 {
			word = "schemas "
		}
		parts = append(parts, "in "+word+list+" ("+g.tables+")")
	}
	if hidden > 0 {
		parts = append(parts, fmt.Sprintf("in %d more schemas", hidden))
	}
	flags := []string{"--schema"}
	if otherInbox {
		flags = append(flags, "--inbox-table")
	}
	if otherOutbox {
		flags = append(flags, "--outbox-table")
	}
	return fmt.Errorf("no exactly-once tables in schema %q; found them %s: pass the service's %s",
		db.Schema, joinAnd(parts), joinAnd(flags)), false, nil
}

// advice is the flags to pass: given values, and flags whose value the
// operator must choose.
type advice struct {
	concrete, choose []string
}

// table advises flag with the one table of names, or to choose among them.
func (a *advice) table(flag string, names []string) {
	if len(names) == 1 {
		a.concrete = append(a.concrete, flag+" "+names[0])
	} else {
		a.choose = append(a.choose, flag)
	}
}

func (a advice) String() string {
	s := "pass " + strings.Join(a.concrete, " ")
	if len(a.choose) > 0 {
		if len(a.concrete) > 0 {
			s += " and "
		}
		s += "the service's " + joinAnd(a.choose)
	}
	return s
}

// describe names the tables of one schema: inbox table "a", outbox table "b".
func describe(st schemaTables) string {
	var parts []string
	if len(st.inbox) > 0 {
		parts = append(parts, tableList("inbox", st.inbox))
	}
	if len(st.outbox) > 0 {
		parts = append(parts, tableList("outbox", st.outbox))
	}
	return strings.Join(parts, ", ")
}

// tableList is `inbox table "a"` or `inbox tables "a", "b"`.
func tableList(kind string, names []string) string {
	quoted := make([]string, len(names))
	for i, n := range names {
		quoted[i] = fmt.Sprintf("%q", n)
	}
	if len(names) == 1 {
		return kind + " table " + quoted[0]
	}
	return kind + " tables " + strings.Join(quoted, ", ")
}

// joinAnd joins a list as prose: "a", "a and b", "a, b and c".
func joinAnd(s []string) string {
	if len(s) <= 1 {
		return strings.Join(s, "")
	}
	return strings.Join(s[:len(s)-1], ", ") + " and " + s[len(s)-1]
}
