package main

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
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

// libraryTables returns the library's tables of every schema, by schema.
// The search is internal/outboxdb's LibraryTables.
func libraryTables(ctx context.Context, db sqlschema.DB) ([]schemaTables, error) {
	st, err := outboxdb.New(db)
	if err != nil {
		return nil, err
	}
	found, err := st.LibraryTables(ctx, db.Conn)
	if err != nil {
		return nil, err
	}
	var out []schemaTables
	for _, t := range found {
		if len(out) == 0 || out[len(out)-1].schema != t.Schema {
			out = append(out, schemaTables{schema: t.Schema})
		}
		st := &out[len(out)-1]
		if t.Inbox {
			st.inbox = append(st.inbox, t.Name)
		} else {
			st.outbox = append(st.outbox, t.Name)
		}
	}
	return out, nil
}

// tablesElsewhere is called when no migration of db's inbox table
// (noInbox) or of its outbox table (noOutbox) is recorded. It returns the
// error that says where the library's tables are when the catalog shows
// that a flag is wrong, and nil when 'migrate up' is the right advice: a
// missing table is nowhere else in the schema, and with both missing,
// nowhere in the database (then nowhere is true); or the tables are there
// and were created without recording migrations ('migrate sql').
func tablesElsewhere(ctx context.Context, db sqlschema.DB, noInbox, noOutbox bool) (hint error, nowhere bool, err error) {
	found, err := libraryTables(ctx, db)
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
