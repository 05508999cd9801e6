package main

import (
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
)

// newTable returns a tabwriter for aligned columns; call Flush.
func newTable(w io.Writer) *tabwriter.Writer {
	return tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
}

// fmtTime is a time for humans: UTC, to the second.
func fmtTime(t time.Time) string {
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

// fmtTimeAgo is a time for humans with how long ago it was.
func fmtTimeAgo(t time.Time, now time.Time) string {
	return fmtTime(t) + " (" + fmtDuration(now.Sub(t)) + " ago)"
}

// fmtDuration rounds d for humans: 3d4h, 5h12m, 2m3s, 1.2s, 15ms.
func fmtDuration(d time.Duration) string {
	if d < 0 {
		d = 0
	}
	switch {
	case d >= 24*time.Hour:
		days := d / (24 * time.Hour)
		if h := (d - days*24*time.Hour) / time.Hour; h > 0 {
			return fmt.Sprintf("%dd%dh", days, h)
		}
		return fmt.Sprintf("%dd", days)
	case d >= time.Minute:
		s := strings.TrimSuffix(d.Round(time.Second).String(), "0s")
		if strings.HasSuffix(s, "h0m") {
			s = strings.TrimSuffix(s, "0m")
		}
		return s
	case d >= time.Second:
		return d.Round(100 * time.Millisecond).String()
	default:
		return d.Round(time.Millisecond).String()
	}
}

// jsonTime is a time for JSON documents: RFC 3339 in UTC, or null.
func jsonTime(t *time.Time) *string {
	if t == nil {
		return nil
	}
	s := t.UTC().Format(time.RFC3339Nano)
	return &s
}

// truncate shortens s to n runes for a table cell, on one line.
func truncate(s string, n int) string {
	s = oneLine(s)
	r := []rune(s)
	if len(r) <= n {
		return s
	}
	return string(r[:n-1]) + "…"
}

var daysPrefix = regexp.MustCompile(`^([0-9]+)d`)

// parseAge parses a Go duration ("720h", "90m") that may start with a
// number of days ("30d", "1d12h").
func parseAge(s string) (time.Duration, error) {
	var d time.Duration
	rest := s
	if m := daysPrefix.FindStringSubmatch(s); m != nil {
		days, err := strconv.Atoi(m[1])
		if err != nil || days > 100000 {
			return 0, fmt.Errorf("invalid duration %q", s)
		}
		d = time.Duration(days) * 24 * time.Hour
		rest = s[len(m[0]):]
	}
	if rest != "" {
		r, err := time.ParseDuration(rest)
		if err != nil {
			return 0, fmt.Errorf("invalid duration %q (examples: 720h, 30d, 1d12h)", s)
		}
		d += r
	}
	return d, nil
}

// plural is "1 record", "2 records".
func plural(n int64, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}
