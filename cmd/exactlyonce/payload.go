package main

import (
	"fmt"
	"unicode/utf8"
)

// showPayloadBytes is the most bytes of a payload that outbox show and
// parked show read and print without --full-payload, as the console
// shows: a quarantined row's payload is often megabytes (the broker
// refused it as too large), a parked message's up to 64 MiB, and a
// terminal shows the first kilobytes usefully; the store reads that
// prefix only.
const showPayloadBytes = 64 << 10

const fullPayloadUsage = "read and print the whole payload (default: its first 64 KiB)"

// cutPayload is p, a prefix of a payload of size bytes (cut when shorter),
// without the first bytes of a character the cut split (so that text
// stays text), and whether it is cut.
func cutPayload(p []byte, size int) ([]byte, bool) {
	if len(p) >= size {
		return p, false
	}
	for i := len(p) - 1; i >= 0 && i >= len(p)-utf8.UTFMax; i-- {
		if utf8.RuneStart(p[i]) {
			if !utf8.FullRune(p[i:]) && utf8.Valid(p[:i]) {
				return p[:i], true
			}
			break
		}
	}
	return p, true
}

// shownPayloadDoc is payloadDoc of the part of a payload shown (p, of a
// payload of size bytes), and whether it is cut.
func shownPayloadDoc(p []byte, size int) (*payloadJSON, *bool) {
	shown, cut := cutPayload(p, size)
	return payloadDoc(shown), &cut
}

// shownPayloadText is what show prints after "payload (N bytes)": the
// payload (p, of a payload of size bytes), pretty-printed, or, when p is
// a prefix, which part is shown and how to print all of it.
func shownPayloadText(p []byte, size int) string {
	shown, cut := cutPayload(p, size)
	if !cut {
		return ":\n" + prettyPayload(shown)
	}
	return fmt.Sprintf(", the first %d shown (the same command with --full-payload prints all of it):\n%s", len(shown), prettyPayload(shown))
}
