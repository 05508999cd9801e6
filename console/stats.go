package console

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// The overview's figures are computed in the background, at most every
// Config.StatsInterval: inbox.Store.Stats scans the inbox (each
// consumer's part of its primary key), which takes seconds on a table of
// millions of records, while the overview must answer in milliseconds. A
// request finds the last figures; when they are older than the interval
// it starts the next computation (one at a time) and answers with what it
// has. Only the very first request waits for them, at most firstWait.

// firstWait bounds how long a request waits for the first figures.
const firstWait = time.Second

// refreshTimeout bounds one computation of the figures.
const refreshTimeout = 2 * time.Minute

// consumerFigures are one consumer's figures. A figure the store cannot
// count is null (the Redis store counts its parked keys and messages
// only: the rest would mean scanning its keyspace).
type consumerFigures struct {
	Consumer string `json:"consumer"`
	Store    string `json:"store"`
	// Records by status; Done is "processed".
	Processing *int64 `json:"processing"`
	Done       *int64 `json:"done"`
	Failed     *int64 `json:"failed"`
	Parked     *int64 `json:"parked"`
	// Discarded counts the keys whose parked message an operator
	// discarded (their deliveries are dropped as duplicates).
	Discarded *int64 `json:"discarded"`
	Total     *int64 `json:"total"`
	// Duplicates counts the deliveries dropped as duplicates of the
	// records still in the table.
	Duplicates *int64 `json:"duplicates"`
	// ParkedMessages counts the kept messages of parked (and released)
	// keys: what the parked list shows.
	ParkedMessages    *int64     `json:"parked_messages"`
	OldestFirstSeenAt *time.Time `json:"oldest_first_seen_at"`
	// Error says why the figures are missing, as the API would answer
	// for it (the details are in the server's log).
	Error string `json:"error,omitempty"`
}

// outboxFigures are the outbox backlog's (outbox.Store.Pending).
type outboxFigures struct {
	// Pending counts the rows not relayed yet, quarantined ones included.
	Pending int64 `json:"pending"`
	// Failing counts those whose publish failed and that are retried.
	Failing int64 `json:"failing"`
	// Quarantined counts those the relay gave up on.
	Quarantined int64 `json:"quarantined"`
	// BlockedKeys counts the ordering keys with a failing or quarantined
	// row, which holds back the later rows of its key.
	BlockedKeys int64 `json:"blocked_keys"`
	// BlockedRows counts the rows waiting behind such a row of their key.
	BlockedRows int64 `json:"blocked_rows"`
	// OldestPendingAgeSeconds is the age of the oldest row not
	// quarantined: the relay's lag; null when there is none.
	OldestPendingAgeSeconds *float64   `json:"oldest_pending_age_seconds"`
	OldestPendingCreatedAt  *time.Time `json:"oldest_pending_created_at"`
}

// snapshot is one computation of the overview's figures.
type snapshot struct {
	AsOf          time.Time         `json:"as_of"`
	TookSeconds   float64           `json:"took_seconds"`
	Consumers     []consumerFigures `json:"consumers"`
	ConsumersMore bool              `json:"consumers_more"`
	Outbox        *outboxFigures    `json:"outbox"`
	Relays        []relayInfo       `json:"relays"`
	Errors        []string          `json:"errors"`
}

func (s *snapshot) consumer(store, name string) (consumerFigures, bool) {
	if s == nil {
		return consumerFigures{}, false
	}
	for _, c := range s.Consumers {
		if c.Store == store && c.Consumer == name && c.Error == "" {
			return c, true
		}
	}
	return consumerFigures{}, false
}

// maxStaleGap bounds the gap between the computations that actions
// start (statsCache.gap).
const maxStaleGap = 5 * time.Second

type statsCache struct {
	h        *handler
	interval time.Duration
	// gap is the least time between two computations started because
	// actions made the figures stale: min(interval, maxStaleGap), so that
	// a stream of actions does not make every request compute them.
	gap time.Duration

	mu      sync.Mutex
	snap    *snapshot
	running chan struct{} // while a computation runs; closed when it ends
	started time.Time     // when the last computation started
	// stale says an action happened since the last computation started;
	// staleStarted is when the last computation for one started.
	stale        bool
	staleStarted time.Time
}

func newStatsCache(h *handler, interval time.Duration) *statsCache {
	return &statsCache{h: h, interval: interval, gap: min(interval, maxStaleGap)}
}

// get returns the last figures (nil before the first computation ended)
// and whether a computation is running; it starts one when the last is
// older than the interval, or when an action made them stale and the
// last computation for an action started at least gap ago.
func (c *statsCache) get(ctx context.Context) (*snapshot, bool) {
	c.mu.Lock()
	now := time.Now()
	due := c.snap == nil || now.Sub(c.started) >= c.interval
	dirty := c.stale && now.Sub(c.staleStarted) >= c.gap
	if c.running == nil && (due || dirty) {
		if c.stale {
			c.staleStarted = now
		}
		c.start()
	}
	snap, running := c.snap, c.running
	c.mu.Unlock()
	if snap == nil && running != nil {
		t := time.NewTimer(firstWait)
		defer t.Stop()
		select {
		case <-running:
		case <-t.C:
		case <-ctx.Done():
		}
		c.mu.Lock()
		snap, running = c.snap, c.running
		c.mu.Unlock()
	}
	return snap, running != nil
}

// start runs a computation in the background; c.mu is held.
func (c *statsCache) start() {
	done := make(chan struct{})
	c.running, c.started, c.stale = done, time.Now(), false
	go func() {
		defer close(done)
		ctx, cancel := context.WithTimeout(context.Background(), refreshTimeout)
		defer cancel()
		snap := c.h.compute(ctx)
		c.mu.Lock()
		defer c.mu.Unlock()
		c.running = nil
		if c.snap != nil && snap.failed() {
			// Keep the figures that were good, saying why they are old.
			old := *c.snap
			old.Errors = snap.Errors
			c.snap = &old
			return
		}
		c.snap = snap
	}()
}

// markStale makes a request start a computation (after an action): the
// next one, unless a computation for an action started less than gap
// ago (then the first request after the gap). A computation running now
// may have read the figures before the action; it is not stopped, and
// the one after it catches up.
func (c *statsCache) markStale() {
	c.mu.Lock()
	c.stale = true
	c.mu.Unlock()
}

// wait waits for a running computation (the tests' way to end cleanly).
func (c *statsCache) wait() {
	c.mu.Lock()
	running := c.running
	c.mu.Unlock()
	if running != nil {
		<-running
	}
}

// failed reports whether nothing could be computed.
func (s *snapshot) failed() bool {
	if len(s.Errors) == 0 {
		return false
	}
	for _, c := range s.Consumers {
		if c.Error == "" {
			return false
		}
	}
	return s.Outbox == nil
}

// compute computes the overview's figures.
func (h *handler) compute(ctx context.Context) *snapshot {
	start := time.Now()
	s := &snapshot{AsOf: start, Consumers: []consumerFigures{}, Relays: []relayInfo{}, Errors: []string{}}
	// fail logs err (once per computation: requests are served the
	// snapshot) and shows what the API would answer for it: the driver's
	// error names the database role, the database and its address, and
	// the overview is shown to every signed-in user.
	fail := func(what string, err error) string {
		h.log.Error("exactlyonce console: computing the overview's figures", "what", what, "error", err)
		shown := shownError(err)
		s.Errors = append(s.Errors, what+": "+shown)
		return shown
	}
	if h.pg != nil {
		names := h.cfg.Consumers
		if len(names) == 0 {
			var err error
			names, err = h.pg.Consumers(ctx, overviewConsumers+1)
			if err != nil {
				fail("listing the inbox's consumers", err)
			}
			if len(names) > overviewConsumers {
				names, s.ConsumersMore = names[:overviewConsumers], true
			}
		}
		for _, c := range names {
			f, err := h.pgFigures(ctx, c)
			if err != nil {
				f.Error = fail(fmt.Sprintf("consumer %q", c), err)
			}
			s.Consumers = append(s.Consumers, f)
		}
		if p, err := h.rows.Pending(ctx); err != nil {
			fail("the outbox's backlog", err)
		} else {
			s.Outbox = outboxFiguresOf(p)
		}
		if rs, err := h.relays(ctx); err != nil {
			fail("the relays", err)
		} else {
			s.Relays = rs
		}
	}
	for _, c := range h.cfg.RedisConsumers {
		f, err := h.redisFigures(ctx, c)
		if err != nil {
			f.Error = fail(fmt.Sprintf("Redis consumer %q", c), err)
		}
		s.Consumers = append(s.Consumers, f)
	}
	s.TookSeconds = time.Since(start).Seconds()
	return s
}

func outboxFiguresOf(p outbox.Pending) *outboxFigures {
	o := &outboxFigures{Pending: p.Count, Failing: p.Failing, Quarantined: p.Quarantined, BlockedKeys: p.BlockedKeys, BlockedRows: p.Blocked,
		OldestPendingCreatedAt: p.OldestCreatedAt}
	if p.OldestCreatedAt != nil {
		age := p.OldestAge.Seconds()
		o.OldestPendingAgeSeconds = &age
	}
	return o
}

func ptr[T any](v T) *T { return &v }

// pgFigures counts a consumer's records (a scan of its part of the
// inbox's primary key) and parked messages (an index look-up).
func (h *handler) pgFigures(ctx context.Context, consumer string) (consumerFigures, error) {
	f := consumerFigures{Consumer: consumer, Store: storePostgres}
	st, err := h.pg.Stats(ctx, consumer)
	if err != nil {
		return f, err
	}
	n, err := h.pg.CountParked(ctx, inbox.ParkedFilter{Consumer: consumer})
	if err != nil {
		return f, err
	}
	f.Processing, f.Done, f.Failed, f.Parked = ptr(st.Rows["processing"]), ptr(st.Rows["done"]), ptr(st.Rows["failed"]), ptr(st.Rows["parked"])
	f.Discarded = ptr(st.Rows["discarded"])
	f.Total, f.Duplicates, f.ParkedMessages, f.OldestFirstSeenAt = ptr(st.Total), ptr(st.Duplicates), ptr(n), st.OldestFirstSeen
	return f, nil
}

// redisFigures counts a Redis consumer's parked keys and messages (reads
// of its parked set: O(parked keys)).
func (h *handler) redisFigures(ctx context.Context, consumer string) (consumerFigures, error) {
	f := consumerFigures{Consumer: consumer, Store: storeRedis}
	keys, err := h.cfg.Redis.CountParkedKeys(ctx, consumer)
	if err != nil {
		return f, err
	}
	n, err := h.cfg.Redis.CountParked(ctx, inbox.ParkedFilter{Consumer: consumer})
	if err != nil {
		return f, err
	}
	f.Parked, f.ParkedMessages = ptr(keys), ptr(n)
	return f, nil
}
