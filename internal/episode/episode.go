// Package episode logs a failure that repeats (the database unreachable,
// tables not migrated, a configuration error) as an episode of a few lines
// instead of one line per failure: an ERROR line when it starts, with the
// error; an ERROR line every Interval while it goes on, with the number of
// failures; an INFO line when it ends, with its length and the count.
//
// An episode ends on a success (End) only once no failure of it was seen
// for Quiet: a cause that fails some keys while others succeed (one bad
// key, one shard down) stays one episode instead of flapping between
// "started" and "ended". An episode whose last failure is older than
// twice the interval is over: the next failure ends it and starts another.
package episode

import (
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
)

// Defaults of New.
const (
	DefaultInterval = 30 * time.Second
	DefaultQuiet    = 5 * time.Second
)

// Log tracks the open episodes of one component. Use New.
type Log struct {
	logger   watermill.LoggerAdapter
	interval time.Duration
	quiet    time.Duration
	now      func() time.Time

	open atomic.Int32 // open episodes: End's fast path when none
	// mu also orders the lines: an episode's end is never logged before
	// its start.
	mu  sync.Mutex
	eps map[string]*episode
}

type episode struct {
	what                  string
	start, last, lastFail time.Time // opened, last logged, last failure
	count                 int       // failures since start
	sinceLast             int       // failures since the last line
}

// New returns a Log writing to logger; a zero interval or quiet means its
// default.
func New(logger watermill.LoggerAdapter, interval, quiet time.Duration) *Log {
	if interval <= 0 {
		interval = DefaultInterval
	}
	if quiet <= 0 {
		quiet = DefaultQuiet
	}
	return &Log{logger: logger, interval: interval, quiet: quiet, now: time.Now, eps: map[string]*episode{}}
}

// Fail records one failure of the episode kind (a key that groups
// failures with one cause; what describes it, as the start of the log
// line: "exactlyonce: database unavailable"). The first failure of an
// episode is logged with err and fields, then one line per interval.
// It reports whether it logged.
func (l *Log) Fail(kind, what string, err error, fields watermill.LogFields) bool {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	e, ok := l.eps[kind]
	if ok && now.Sub(e.lastFail) > 2*l.interval {
		l.end(kind, e, e.lastFail)
		ok = false
	}
	if !ok {
		e = &episode{what: what, start: now, last: now}
		l.eps[kind] = e
		l.open.Add(1)
	}
	e.count++
	e.sinceLast++
	e.lastFail = now
	switch {
	case !ok:
		l.logger.Error(what+" (logged again every "+l.interval.String()+" while it goes on, and when it ends)", err, fields)
	case now.Sub(e.last) >= l.interval:
		l.logger.Error(what+": going on for "+round(now.Sub(e.start))+", "+strconv.Itoa(e.count)+" failures so far ("+strconv.Itoa(e.sinceLast)+" since the last line)", err, fields)
	default:
		return false
	}
	e.last, e.sinceLast = now, 0
	return true
}

// End records a success that shows the episodes of the given kinds are
// over: each open one whose last failure is at least Quiet old ends, with
// an INFO line. Cheap when no episode is open.
func (l *Log) End(kinds ...string) {
	if l.open.Load() == 0 {
		return
	}
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, k := range kinds {
		if e, ok := l.eps[k]; ok && now.Sub(e.lastFail) >= l.quiet {
			l.end(k, e, now)
		}
	}
}

// end closes e (l.mu held).
func (l *Log) end(kind string, e *episode, at time.Time) {
	delete(l.eps, kind)
	l.open.Add(-1)
	l.logger.Info(e.what+": ended after "+round(at.Sub(e.start))+", "+strconv.Itoa(e.count)+" failures", nil)
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
