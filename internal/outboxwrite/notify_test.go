package outboxwrite

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// At most one NOTIFY per NotifyDebounce per Writer; a NOTIFY taken back
// (its statement failed) lets the next writer send one; Writers do not
// share their debounce.
func TestShouldNotifyDebouncesPerWriter(t *testing.T) {
	t.Parallel()
	var w, other Writer
	t0 := time.Unix(1_000_000, 0)
	at := t0.Add

	ok, _ := w.shouldNotify(at(0))
	require.True(t, ok, "the first writer sends one")
	ok, _ = w.shouldNotify(at(5 * time.Millisecond))
	require.False(t, ok, "within the debounce")
	ok, _ = other.shouldNotify(at(5 * time.Millisecond))
	require.True(t, ok, "another Writer has its own debounce")

	ok, undo := w.shouldNotify(at(NotifyDebounce))
	require.True(t, ok, "once the debounce is over")
	undo()
	ok, _ = w.shouldNotify(at(NotifyDebounce + time.Millisecond))
	require.True(t, ok, "a NOTIFY taken back does not count")
	ok, _ = w.shouldNotify(at(NotifyDebounce + 2*time.Millisecond))
	require.False(t, ok)
}
