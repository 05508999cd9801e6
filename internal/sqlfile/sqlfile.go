// Package sqlfile loads the statements of a storage layer from embedded .sql
// files and renders them once per table set.
//
// A file holds one or more statements, each introduced by a line
//
//	-- name: ClaimInsert
//
// and running to the next such line or the end of the file. A statement is a
// text/template: it names the tables of the set it is rendered for
// ({{.Inbox}}, {{.Outbox}}, …: whatever the data passed to Render has), so
// identifiers are quoted once, by the caller, and values always travel as
// parameters ($1, $2, …). Render fails if two statements share a name, and
// Statements.Get panics for a name no file defines, so a typo is found by
// the first test that builds the store, not by a user.
package sqlfile

import (
	"bufio"
	"bytes"
	"fmt"
	"io/fs"
	"sort"
	"strings"
	"text/template"
)

// Statements is the rendered statements of one table set, by name.
type Statements struct {
	byName map[string]string
}

// Render parses every *.sql file under dir in fsys and renders each
// statement with data.
func Render(fsys fs.FS, dir string, data any) (Statements, error) {
	files, err := fs.Glob(fsys, dir+"/*.sql")
	if err != nil {
		return Statements{}, err
	}
	if len(files) == 0 {
		return Statements{}, fmt.Errorf("sqlfile: no .sql files in %s", dir)
	}
	sort.Strings(files)
	out := Statements{byName: map[string]string{}}
	for _, f := range files {
		src, err := fs.ReadFile(fsys, f)
		if err != nil {
			return Statements{}, err
		}
		parsed, err := Parse(src)
		if err != nil {
			return Statements{}, fmt.Errorf("sqlfile: %s: %w", f, err)
		}
		for _, st := range parsed {
			if _, dup := out.byName[st.Name]; dup {
				return Statements{}, fmt.Errorf("sqlfile: %s: statement %q is defined twice", f, st.Name)
			}
			text, err := Execute(st, data)
			if err != nil {
				return Statements{}, fmt.Errorf("sqlfile: %s: %w", f, err)
			}
			out.byName[st.Name] = text
		}
	}
	return out, nil
}

// Get returns the statement called name. It panics when no file defines it:
// that is a programming error of the storage layer, found by its tests.
func (s Statements) Get(name string) string {
	q, ok := s.byName[name]
	if !ok {
		panic("sqlfile: no statement named " + name)
	}
	return q
}

// Names returns the names of the statements, sorted.
func (s Statements) Names() []string {
	names := make([]string, 0, len(s.byName))
	for n := range s.byName {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Statement is one named statement of a file, not yet rendered.
type Statement struct {
	Name string
	Text string
}

// Parse splits src into its named statements.
func Parse(src []byte) ([]Statement, error) {
	var out []Statement
	var cur *Statement
	var body strings.Builder
	flush := func() {
		if cur != nil {
			cur.Text = strings.TrimSpace(body.String())
			out = append(out, *cur)
		}
		body.Reset()
	}
	sc := bufio.NewScanner(bytes.NewReader(src))
	sc.Buffer(make([]byte, 0, 64*1024), 1<<20)
	line := 0
	for sc.Scan() {
		line++
		t := sc.Text()
		if name, ok := strings.CutPrefix(strings.TrimSpace(t), "-- name:"); ok {
			flush()
			name = strings.TrimSpace(name)
			if name == "" {
				return nil, fmt.Errorf("line %d: a statement without a name", line)
			}
			cur = &Statement{Name: name}
			continue
		}
		if cur == nil {
			if s := strings.TrimSpace(t); s != "" && !strings.HasPrefix(s, "--") {
				return nil, fmt.Errorf("line %d: SQL before the first \"-- name:\" line", line)
			}
			continue
		}
		body.WriteString(t)
		body.WriteByte('\n')
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	flush()
	for _, st := range out {
		if st.Text == "" {
			return nil, fmt.Errorf("statement %q is empty", st.Name)
		}
	}
	return out, nil
}

// Execute renders one statement with data. A field data lacks is an error,
// not an empty string.
func Execute(st Statement, data any) (string, error) {
	t, err := template.New(st.Name).Option("missingkey=error").Parse(st.Text)
	if err != nil {
		return "", fmt.Errorf("statement %q: %w", st.Name, err)
	}
	var b strings.Builder
	if err := t.Execute(&b, data); err != nil {
		return "", fmt.Errorf("statement %q: %w", st.Name, err)
	}
	return b.String(), nil
}
