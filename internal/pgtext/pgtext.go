// Package pgtext holds the rules for strings stored in PostgreSQL text and
// jsonb columns, shared by the inbox and the outbox: valid UTF-8, no NUL.
package pgtext

import (
	"errors"
	"strings"
	"unicode/utf8"
)

var (
	// ErrNotUTF8 means a string is not valid UTF-8.
	ErrNotUTF8 = errors.New("not valid UTF-8")
	// ErrNUL means a string contains a NUL byte, which PostgreSQL text and
	// jsonb cannot hold.
	ErrNUL = errors.New("contains a NUL byte")
)

// Check reports whether s can be stored unchanged.
func Check(s string) error {
	if !utf8.ValidString(s) {
		return ErrNotUTF8
	}
	if strings.IndexByte(s, 0) >= 0 {
		return ErrNUL
	}
	return nil
}

// Storable turns any string (an error text, say) into one that can be
// stored: invalid bytes and NUL become U+FFFD, and a string longer than max
// bytes is cut at a character boundary and marked with "...".
func Storable(s string, max int) string {
	if Check(s) != nil {
		var b strings.Builder
		for _, r := range s { // each invalid byte decodes as U+FFFD
			if r == 0 {
				r = utf8.RuneError
			}
			b.WriteRune(r)
		}
		s = b.String()
	}
	if len(s) <= max {
		return s
	}
	cut := 0
	for i := range s {
		if i > max {
			break
		}
		cut = i
	}
	return s[:cut] + "..."
}

// MaxErrorText bounds every error text the library stores (the inbox's and
// the outbox's last_error), in bytes.
const MaxErrorText = 2000

// Truncate makes an error text storable and at most MaxErrorText bytes.
func Truncate(s string) string { return Storable(s, MaxErrorText) }
