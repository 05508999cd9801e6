package episode

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"
)

type lines struct{ got []string }

func (l *lines) Error(msg string, err error, _ watermill.LogFields) {
	l.got = append(l.got, "ERROR "+msg+" err="+err.Error())
}
func (l *lines) Info(msg string, _ watermill.LogFields)           { l.got = append(l.got, "INFO "+msg) }
func (l *lines) Debug(string, watermill.LogFields)                {}
func (l *lines) Trace(string, watermill.LogFields)                {}
func (l *lines) With(watermill.LogFields) watermill.LoggerAdapter { return l }

func TestEpisode(t *testing.T) {
	var out lines
	l := New(&out, 30*time.Second, 5*time.Second)
	now := time.Unix(1000, 0)
	l.now = func() time.Time { return now }
	l.End("db") // nothing open: nothing logged
	require.Empty(t, out.got)

	boom := errors.New("connection refused")
	require.True(t, l.Fail("db", "database unavailable", boom, nil), "the first failure starts the episode")
	for range 99 {
		now = now.Add(100 * time.Millisecond)
		require.False(t, l.Fail("db", "database unavailable", boom, nil))
	}
	require.True(t, l.Fail("other", "tables not migrated", boom, nil), "another kind is its own episode")
	now = now.Add(21 * time.Second) // 30.9 s after the start
	require.True(t, l.Fail("db", "database unavailable", boom, nil), "a line per interval while it goes on")
	require.True(t, l.Open("db"))
	now = now.Add(4 * time.Second)
	l.End("db")
	require.True(t, l.Open("db"), "a success within Quiet of a failure ends nothing: one bad key among good ones")
	now = now.Add(time.Second)
	l.End("db")
	require.False(t, l.Open("db"))
	require.True(t, l.Open("other"))
	l.End("db") // already ended
	require.Equal(t, []string{
		"ERROR database unavailable (logged again every 30s while it goes on, and when it ends) err=connection refused",
		"ERROR tables not migrated (logged again every 30s while it goes on, and when it ends) err=connection refused",
		"ERROR database unavailable: going on for 30.9s, 101 failures so far (100 since the last line) err=connection refused",
		"INFO database unavailable: ended after 35.9s, 101 failures",
	}, out.got)
	require.True(t, l.Fail("db", "database unavailable", boom, nil), "a new episode starts after the end")
	require.True(t, strings.HasSuffix(out.got[len(out.got)-1], "err=connection refused"))

	// An episode nobody ended (no success came) is over once its last
	// failure is older than twice the interval: the next failure starts
	// another, after the old one's end.
	out.got = nil
	now = now.Add(10 * time.Minute)
	require.True(t, l.Fail("db", "database unavailable", boom, nil))
	require.Equal(t, []string{
		"INFO database unavailable: ended after 0s, 1 failures",
		"ERROR database unavailable (logged again every 30s while it goes on, and when it ends) err=connection refused",
	}, out.got)
}
