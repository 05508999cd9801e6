package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
)

// line is one row of the table: variant A against variant B, one value of
// each per round.
type line struct {
	name         string // what is compared, and where
	aName, bName string
	a, b         []float64
	unit         string // "msg/s", "events/s", "tx/s", "MiB", "ms"
	// target describes the goal; check says whether the medians meet it
	// (nil: informational line).
	target string
	check  func(a, b, ratio float64) bool
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// ratio is the ratio of the medians, rounded as printed (two decimals), so
// that the verdict agrees with the figure shown.
func (l *line) ratio() float64 { return math.Round(100*median(l.a)/median(l.b)) / 100 }

func (l *line) verdict() string {
	if l.check == nil {
		return "—"
	}
	if l.check(median(l.a), median(l.b), l.ratio()) {
		return "met"
	}
	return "**missed**"
}

// value formats one measurement in the line's unit.
func (l *line) value(v float64) string {
	if l.unit == "MiB" || l.unit == "ms" {
		return strconv.FormatFloat(v, 'f', 1, 64)
	}
	return thousands(int64(math.Round(v)))
}

func (l *line) cell(v []float64) string {
	return fmt.Sprintf("%s %s (%s–%s)", l.value(median(v)), l.unit, l.value(slices.Min(v)), l.value(slices.Max(v)))
}

func thousands(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}

// printTable writes the lines as one Markdown table: medians over the
// rounds, with min–max in parentheses, and the ratio of the medians.
func printTable(w io.Writer, lines []*line) {
	fmt.Fprintln(w, "| # | line | A | B | A: median (min–max) | B: median (min–max) | A/B | target | |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|---|")
	for i, l := range lines {
		fmt.Fprintf(w, "| %d | %s | %s | %s | %s | %s | %.2f | %s | %s |\n",
			i+1, l.name, l.aName, l.bName, l.cell(l.a), l.cell(l.b), l.ratio(), l.target, l.verdict())
	}
	if len(lines) > 0 {
		fmt.Fprintf(w, "\nEvery value is the median of %d rounds (min–max in parentheses); A/B is the ratio of the medians.\n", len(lines[0].a))
	}
}

// short names a count: 1000 -> 1k, 1000000 -> 1M.
func short(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return strconv.Itoa(n/1_000_000) + "M"
	case n >= 1000 && n%1000 == 0:
		return strconv.Itoa(n/1000) + "k"
	}
	return strconv.Itoa(n)
}
