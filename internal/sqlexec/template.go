package sqlexec

import (
	"fmt"
	"slices"
	"strings"
)

// Hole is the text that marks a run-time hole called name in a rendered
// statement: a storage layer's template data returns it from a method
// (`{{.Run "Partition"}}` in a .sql file), and NewTemplate finds it. It is
// delimited by NUL bytes, which PostgreSQL refuses in a query: a hole left
// unfilled fails the statement.
func Hole(name string) string { return holeMark + name + holeMark }

const holeMark = "\x00"

// Template is a statement of a storage layer's .sql files with holes filled
// at run time: rendered once per table set like every statement, then split
// at its holes, so that filling it is a concatenation of fixed pieces and
// the values. Only what cannot be a parameter is a hole (an identifier
// computed at run time, the literals of a multi-statement simple-protocol
// query): each storage package's documentation lists its templates.
type Template struct {
	parts []string // len(holes)+1
	holes []int    // index into names, per hole
	names []string // the hole names, in order of first appearance
}

// NewTemplate splits text at its holes, which must be exactly names (in
// order of first appearance).
func NewTemplate(text string, names ...string) (Template, error) {
	pieces := strings.Split(text, holeMark)
	if len(pieces)%2 == 0 {
		return Template{}, fmt.Errorf("an unclosed run-time hole in %q", text)
	}
	t := Template{}
	for i, p := range pieces {
		if i%2 == 0 {
			t.parts = append(t.parts, p)
			continue
		}
		j := slices.Index(t.names, p)
		if j < 0 {
			t.names = append(t.names, p)
			j = len(t.names) - 1
		}
		t.holes = append(t.holes, j)
	}
	if !slices.Equal(t.names, names) {
		return Template{}, fmt.Errorf("run-time holes %v, want %v", t.names, names)
	}
	return t, nil
}

// Fill returns the statement with the holes filled with vals, one per
// name of newRunTemplate, in that order.
func (t Template) Fill(vals ...string) string {
	if len(vals) != len(t.names) {
		panic(fmt.Sprintf("sqlexec: %d values for the run-time holes %v", len(vals), t.names))
	}
	n := 0
	for _, p := range t.parts {
		n += len(p)
	}
	for _, h := range t.holes {
		n += len(vals[h])
	}
	var b strings.Builder
	b.Grow(n)
	for i, p := range t.parts {
		b.WriteString(p)
		if i < len(t.holes) {
			b.WriteString(vals[t.holes[i]])
		}
	}
	return b.String()
}

// Sample fills every hole with its name in angle brackets: for messages
// and tests.
func (t Template) Sample() string {
	vals := make([]string, len(t.names))
	for i, n := range t.names {
		vals[i] = "<" + n + ">"
	}
	return t.Fill(vals...)
}
