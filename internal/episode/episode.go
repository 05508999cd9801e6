// Package episode logs a failure that repeats (the database unreachable,
// tables not migrated, a configuration error) as an episode of a few lines
// instead of one line per failure: an ERROR line when it starts, with the
// error; an ERROR line every Interval while it goes on, with the number of
// failures; an INFO line when it ends, with its length and the count.
package episode

import (
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// DefaultInterval is how often a going-on episode is logged.
const DefaultInterval = 30 * time.Second

// Log tracks the open episodes of one component. The zero value is not
// usable: use New.
type Log struct {
	logger   watermill.LoggerAdapter
	interval time.Duration
	now      func() time.Time

	open atomic.Int32 // open episodes: End's fast path when none
	mu   sync.Mutex
	eps  map[string]*episode
}

type episode struct {
	what        string
	start, last time.Time // opened, last logged
	count       int       // failures since start
	sinceLast   int       // failures since the last line
}

// New returns a Log writing to logger; interval 0 means DefaultInterval.
func New(logger watermill.LoggerAdapter, interval time.Duration) *Log {
	if interval <= 0 {
		interval = DefaultInterval
	}
	return &Log{logger: logger, interval: interval, now: time.Now, eps: map[string]*episode{}}
}

// Fail records one failure of the episode kind (a key that groups
// failures with one cause; what describes it, as the start of the log
// line: "exactlyonce: database unavailable"). The first failure of an
// episode is logged with err and fields, then one line per interval.
// It reports whether it logged.
func (l *Log) Fail(kind, what string, err error, fields watermill.LogFields) bool {
	now := l.now()
	l.mu.Lock()
	e, ok := l.eps[kind]
	if !ok {
		e = &episode{what: what, start: now, last: now}
		l.eps[kind] = e
		l.open.Add(1)
	}
	e.count++
	e.sinceLast++
	var line string
	switch {
	case !ok:
		line = what + " (logged again every " + l.interval.String() + " while it goes on, and when it ends)"
	case now.Sub(e.last) >= l.interval:
		line = what + ": going on for " + round(now.Sub(e.start)) + ", " + strconv.Itoa(e.count) + " failures so far (" + strconv.Itoa(e.sinceLast) + " since the last line)"
	}
	if line != "" {
		e.last, e.sinceLast = now, 0
	}
	l.mu.Unlock()
	if line == "" {
		return false
	}
	l.logger.Error(line, err, fields)
	return true
}

// End closes the episodes of the given kinds, if open, with an INFO line
// each. Cheap when no episode is open.
func (l *Log) End(kinds ...string) {
	if l.open.Load() == 0 {
		return
	}
	now := l.now()
	type ended struct {
		what  string
		count int
		took  time.Duration
	}
	var lines []ended
	l.mu.Lock()
	for _, k := range kinds {
		if e, ok := l.eps[k]; ok {
			delete(l.eps, k)
			l.open.Add(-1)
			lines = append(lines, ended{e.what, e.count, now.Sub(e.start)})
		}
	}
	l.mu.Unlock()
	for _, e := range lines {
		l.logger.Info(e.what+": ended after "+round(e.took)+", "+strconv.Itoa(e.count)+" failures", nil)
	}
}

// Open reports whether an episode of kind is open.
func (l *Log) Open(kind string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.eps[kind]
	return ok
}

func round(d time.Duration) string {
	if d < time.Second {
		return d.Round(time.Millisecond).String()
	}
	return d.Round(100 * time.Millisecond).String()
}
