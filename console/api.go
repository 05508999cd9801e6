package console

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/ops"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// parked returns the named store (checked by storeOf): the operator
// layer's, the same actions for both. It reads a message with a bounded
// prefix of its payload only (GetParkedPrefix, with maxShownPayload, or 0
// where the payload is not shown): a payload is read whole by a replay
// alone, inside the store's action.
func (h *handler) parked(store string) ops.Store {
	if store == storeRedis {
		return h.redis
	}
	return h.pgOps
}

// needDB refuses the outbox's endpoints without Config.DB.
func (h *handler) needDB() error {
	if h.pg == nil {
		return unavailable("the outbox is PostgreSQL's: this console has no Config.DB")
	}
	return nil
}

// unknownConsumer checks, for the PostgreSQL inbox, that consumer has a
// record or a parked message; else it returns the 404 that lists the
// known ones. The Redis store keeps no list of its consumers: there an
// unknown consumer finds nothing, as an idle one does.
func (h *handler) unknownConsumer(ctx context.Context, store, consumer string) error {
	if store != storePostgres || consumer == "" {
		return nil
	}
	known, err := h.pgOps.KnownConsumer(ctx, consumer)
	if err != nil || known {
		return err
	}
	names, err := h.pg.Consumers(ctx, overviewConsumers+1)
	if err != nil {
		return err
	}
	which := "no consumer has records"
	if len(names) > 0 {
		which = "consumers with records: " + strings.Join(names[:min(len(names), overviewConsumers)], ", ")
		if len(names) > overviewConsumers {
			which += " and more"
			names = names[:overviewConsumers]
		}
	}
	return &apiError{status: http.StatusNotFound, code: codeUnknownConsumer, consumers: names,
		message: "unknown consumer " + strconv.Quote(consumer) + ": no records in inbox table " + h.cfg.DB.Inbox() + "; " + which}
}

// notFoundOrUnknown is err, or the unknown-consumer error when err says
// the key or message is not there and the consumer has no record at all.
func (h *handler) notFoundOrUnknown(ctx context.Context, store, consumer string, err error) error {
	if errors.Is(err, inbox.ErrNotParked) || errors.Is(err, inbox.ErrNotFound) {
		if cerr := h.unknownConsumer(ctx, store, consumer); cerr != nil {
			return cerr
		}
	}
	return err
}

// refused logs e, a refusal of an action, and returns it.
func (h *handler) refused(r *http.Request, e *apiError) *apiError {
	h.logRefusal(r, e.status, e.code, e.message)
	return e
}

// audit logs an action: who did it, from where, what, on how many.
func (h *handler) audit(r *http.Request, action string, err error, attrs ...any) {
	attrs = append([]any{"user", userOf(r), "remote_addr", r.RemoteAddr, "action", action}, attrs...)
	if err != nil {
		h.log.Warn("exactlyonce console: action failed", append(attrs, "error", err)...)
		return
	}
	h.log.Info("exactlyonce console: action", attrs...)
	// The overview's figures no longer hold: the next request starts their
	// computation instead of serving them for the rest of the interval.
	h.stats.markStale()
}

func readCtx(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(r.Context(), readTimeout)
}

// actionCtx outlives the request (a bulk action is not abandoned halfway
// because the browser went away), bounded by actionTimeout.
func actionCtx(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(r.Context()), actionTimeout)
}

// --- documents

type payloadJSON struct {
	Text   *string `json:"text,omitempty"`
	Base64 *string `json:"base64,omitempty"`
}

// maxShownPayload is the most bytes of a payload the console reads and
// shows (a single message or row; lists show none): the store reads this
// prefix only (a substring in PostgreSQL, a cut inside Redis), so that
// showing a message costs the same whatever its size. 64 KiB holds what an
// operator reads on a page (the payload's first fields, its structure,
// what was wrong with it) many times over, and keeps a page or an answer
// under about half a megabyte once escaped, while the payloads the relay
// quarantines are often megabytes (those the broker refused as too large)
// and a parked message's up to 64 MiB (the middleware's
// MaxParkedPayload). The CLI's show commands print the whole payload on
// request (--full-payload).
const maxShownPayload = 64 << 10

// shownPayload is the part of a payload the console shows: p (a prefix
// of a payload of size bytes: cut when shorter) as UTF-8 text, or as
// base64 when it is not text. A prefix cut inside a character loses the
// character's first bytes, so that text stays text; shown is the number
// of the payload's bytes shown.
func shownPayload(p []byte, size int) (text string, binary bool, shown int) {
	if len(p) < size {
		for i := len(p) - 1; i >= 0 && i >= len(p)-utf8.UTFMax; i-- {
			if utf8.RuneStart(p[i]) {
				if !utf8.FullRune(p[i:]) && utf8.Valid(p[:i]) {
					return string(p[:i]), false, i
				}
				break
			}
		}
	}
	if utf8.Valid(p) {
		return string(p), false, len(p)
	}
	return base64.StdEncoding.EncodeToString(p), true, len(p)
}

// payloadDoc is a payload (p, a prefix of it when shorter than size) as
// the API shows it: UTF-8 text, or base64 when it is not; truncated
// reports whether it was cut.
func payloadDoc(p []byte, size int) (_ *payloadJSON, truncated bool) {
	text, binary, shown := shownPayload(p, size)
	if binary {
		return &payloadJSON{Base64: &text}, shown < size
	}
	return &payloadJSON{Text: &text}, shown < size
}

type recordJSON struct {
	Store         string     `json:"store"`
	Consumer      string     `json:"consumer"`
	Key           string     `json:"key"`
	Status        string     `json:"status"`
	Attempts      int        `json:"attempts"`
	Duplicates    int64      `json:"duplicates"`
	FirstSeenAt   time.Time  `json:"first_seen_at"`
	ProcessedAt   *time.Time `json:"processed_at"`
	LeaseUntil    *time.Time `json:"lease_until"`
	LastError     string     `json:"last_error"`
	Interrupted   bool       `json:"interrupted"`
	Interruptions int        `json:"interruptions"`
	// ParkedMessage reports whether the key has a kept message (GET
	// /api/v1/parked/{consumer}/{key}).
	ParkedMessage bool `json:"parked_message"`
	// Version is the record's (inbox.Record.Version): a forget that
	// passes it acts only on this state.
	Version string `json:"version"`
}

func recordDoc(store string, rec inbox.Record, parked bool) recordJSON {
	return recordJSON{Store: store, Consumer: rec.Consumer, Key: rec.Key, Status: rec.Status, Attempts: rec.Attempts, Duplicates: rec.Duplicates,
		FirstSeenAt: rec.FirstSeenAt, ProcessedAt: rec.ProcessedAt, LeaseUntil: rec.LeaseUntil, LastError: rec.LastError,
		Interrupted: rec.Interrupted, Interruptions: rec.Interruptions, ParkedMessage: parked, Version: rec.Version}
}

type parkedJSON struct {
	Store        string            `json:"store"`
	Consumer     string            `json:"consumer"`
	Key          string            `json:"key"`
	UUID         string            `json:"uuid"`
	Topic        string            `json:"topic"`
	Status       string            `json:"status"`
	Reason       string            `json:"reason"`
	Attempts     int               `json:"attempts"`
	FirstSeenAt  time.Time         `json:"first_seen_at"`
	ParkedAt     time.Time         `json:"parked_at"`
	Metadata     map[string]string `json:"metadata"`
	PayloadBytes int               `json:"payload_bytes"`
	PayloadKept  bool              `json:"payload_kept"`
	Payload      *payloadJSON      `json:"payload,omitempty"`
	// Version is the parked message's (inbox.ParkedMessage.Version): a
	// replay or discard that passes it acts only on this message and park.
	Version string `json:"version"`
	// PayloadTruncated, in a single message's answer, reports whether
	// Payload holds only the first bytes of the payload (at most
	// maxShownPayload; PayloadBytes is its whole size).
	PayloadTruncated *bool `json:"payload_truncated,omitempty"`
}

// parkedDoc is m as the API shows it; withPayload adds m.Payload, read
// with GetParkedPrefix (a prefix of the payload when it is larger).
func parkedDoc(store string, m inbox.ParkedMessage, withPayload bool) parkedJSON {
	d := parkedJSON{Store: store, Consumer: m.Consumer, Key: m.Key, UUID: m.UUID, Topic: m.Topic, Status: m.Status, Reason: m.Reason,
		Attempts: m.Attempts, FirstSeenAt: m.FirstSeenAt, ParkedAt: m.ParkedAt, Metadata: m.Metadata,
		PayloadBytes: m.PayloadSize, PayloadKept: m.PayloadKept, Version: m.Version}
	if d.Metadata == nil {
		d.Metadata = map[string]string{}
	}
	if withPayload && m.PayloadKept {
		var cut bool
		d.Payload, cut = payloadDoc(m.Payload, m.PayloadSize)
		d.PayloadTruncated = &cut
	}
	return d
}

type rowJSON struct {
	ID                int64             `json:"id"`
	Topic             string            `json:"topic"`
	UUID              string            `json:"uuid"`
	State             string            `json:"state"`
	CreatedAt         time.Time         `json:"created_at"`
	QuarantinedAt     *time.Time        `json:"quarantined_at"`
	Failures          int               `json:"failures"`
	PermanentFailures int               `json:"permanent_failures"`
	NextAttemptAt     *time.Time        `json:"next_attempt_at"`
	LastError         string            `json:"last_error"`
	Metadata          map[string]string `json:"metadata"`
	// MetadataRaw is the stored metadata when it is not a JSON object of
	// strings (the relay quarantines such a row).
	MetadataRaw  string       `json:"metadata_raw,omitempty"`
	PayloadBytes int          `json:"payload_bytes"`
	Payload      *payloadJSON `json:"payload,omitempty"`
	// PayloadTruncated, in a single row's answer, reports whether Payload
	// holds only the first bytes of the payload (at most maxShownPayload;
	// PayloadBytes is its whole size).
	PayloadTruncated *bool `json:"payload_truncated,omitempty"`
	// OrderingKey is the row's ordering key, "" when none; Waiting counts
	// the rows of its key behind it when it is failing or quarantined
	// (outbox.Row.Waiting): the rows it holds back.
	OrderingKey string `json:"ordering_key"`
	Waiting     int64  `json:"waiting"`
	// Version is the row's (outbox.Row.Version): a requeue or discard that
	// passes it acts only on this failure record.
	Version string `json:"version"`
}

// rowDoc is r as the API shows it; withPayload adds r.Payload, read with
// GetRowPrefix (a prefix of the payload when it is larger).
func rowDoc(r outbox.Row, withPayload bool) rowJSON {
	d := rowJSON{ID: r.ID, Topic: r.Topic, UUID: r.UUID, State: ops.RowState(r), CreatedAt: r.CreatedAt, QuarantinedAt: r.QuarantinedAt,
		Failures: r.Failures, PermanentFailures: r.PermanentFailures, NextAttemptAt: r.NextAttemptAt, LastError: r.LastError,
		Metadata: r.Metadata, PayloadBytes: r.PayloadSize, OrderingKey: r.OrderingKey, Waiting: r.Waiting, Version: r.Version}
	if d.Metadata == nil {
		d.Metadata = map[string]string{}
		d.MetadataRaw = string(r.RawMetadata)
	}
	if withPayload {
		var cut bool
		d.Payload, cut = payloadDoc(r.Payload, r.PayloadSize)
		d.PayloadTruncated = &cut
	}
	return d
}

// --- overview and consumers

type overviewJSON struct {
	// AsOf is when the figures were computed; null before the first
	// computation ended (then Refreshing is true: ask again).
	AsOf                 *time.Time        `json:"as_of"`
	Refreshing           bool              `json:"refreshing"`
	StatsIntervalSeconds float64           `json:"stats_interval_seconds"`
	Consumers            []consumerFigures `json:"consumers"`
	ConsumersMore        bool              `json:"consumers_more"`
	Outbox               *outboxFigures    `json:"outbox"`
	Relays               []relayInfo       `json:"relays"`
	RelaysNote           string            `json:"relays_note,omitempty"`
	Errors               []string          `json:"errors"`
}

func (h *handler) overviewDoc(snap *snapshot, refreshing bool) overviewJSON {
	d := overviewJSON{Refreshing: refreshing, StatsIntervalSeconds: h.cfg.StatsInterval.Seconds(),
		Consumers: []consumerFigures{}, Relays: []relayInfo{}, Errors: []string{}}
	if h.pg != nil {
		d.RelaysNote = h.relaysNoteOf()
	}
	if snap != nil {
		d.AsOf = &snap.AsOf
		d.Consumers, d.ConsumersMore, d.Outbox, d.Relays, d.Errors = snap.Consumers, snap.ConsumersMore, snap.Outbox, snap.Relays, snap.Errors
	}
	return d
}

func (h *handler) apiOverview(w http.ResponseWriter, r *http.Request) error {
	if err := checkParams(r.URL.Query()); err != nil {
		return err
	}
	snap, refreshing := h.stats.get(r.Context())
	writeJSON(w, http.StatusOK, h.overviewDoc(snap, refreshing))
	return nil
}

func (h *handler) apiConsumers(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	if err := checkParams(q, []string{"store"}); err != nil {
		return err
	}
	store, err := h.storeOf(q.Get("store"))
	if err != nil {
		return err
	}
	names, more := h.cfg.RedisConsumers, false
	if store == storePostgres {
		ctx, cancel := readCtx(r)
		defer cancel()
		if names, err = h.pg.Consumers(ctx, maxLimit+1); err != nil {
			return err
		}
		if len(names) > maxLimit {
			names, more = names[:maxLimit], true
		}
	}
	if names == nil {
		names = []string{}
	}
	writeJSON(w, http.StatusOK, struct {
		Store     string   `json:"store"`
		Consumers []string `json:"consumers"`
		More      bool     `json:"more"`
	}{store, names, more})
	return nil
}

// consumerFiguresOf returns a consumer's figures: the overview's when it
// has them, else counted now.
func (h *handler) consumerFiguresOf(r *http.Request, store, consumer string) (consumerFigures, *time.Time, error) {
	if store == storePostgres {
		snap, _ := h.stats.get(r.Context())
		if f, ok := snap.consumer(store, consumer); ok {
			return f, &snap.AsOf, nil
		}
	}
	ctx, cancel := readCtx(r)
	defer cancel()
	if err := h.unknownConsumer(ctx, store, consumer); err != nil {
		return consumerFigures{}, nil, err
	}
	now := time.Now()
	var f consumerFigures
	var err error
	if store == storeRedis {
		f, err = h.redisFigures(ctx, consumer)
	} else {
		f, err = h.pgFigures(ctx, consumer)
	}
	return f, &now, err
}

func (h *handler) apiConsumer(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	if err := checkParams(q, []string{"store"}); err != nil {
		return err
	}
	store, err := h.storeOf(q.Get("store"))
	if err != nil {
		return err
	}
	consumer := r.PathValue("consumer")
	if err := checkText("consumer", consumer); err != nil {
		return err
	}
	f, asOf, err := h.consumerFiguresOf(r, store, consumer)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, struct {
		AsOf *time.Time `json:"as_of"`
		consumerFigures
	}{asOf, f})
	return nil
}

// keyOf reads the consumer and key of a path, and the key within
// ?tenant= (exactlyonce.KeyByTenant).
func keyOf(r *http.Request, tenant string) (string, string, error) {
	consumer, key := r.PathValue("consumer"), r.PathValue("key")
	if err := checkText("consumer", consumer); err != nil {
		return "", "", err
	}
	if err := checkText("key", key); err != nil {
		return "", "", err
	}
	key, err := tenantKey(tenant, key)
	return consumer, key, err
}

// tenantKey is key within tenant (exactlyonce.KeyByTenant); key itself
// when tenant is "".
func tenantKey(tenant, key string) (string, error) {
	if tenant == "" {
		return key, nil
	}
	if err := checkText("tenant", tenant); err != nil {
		return "", err
	}
	k, err := inbox.TenantKey(tenant, key)
	if err != nil {
		return "", badFilter("tenant: %v", strings.TrimPrefix(err.Error(), "inbox: TenantKey: "))
	}
	return k, nil
}

func (h *handler) apiKey(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	if err := checkParams(q, []string{"store", "tenant"}); err != nil {
		return err
	}
	store, err := h.storeOf(q.Get("store"))
	if err != nil {
		return err
	}
	consumer, key, err := keyOf(r, q.Get("tenant"))
	if err != nil {
		return err
	}
	ctx, cancel := readCtx(r)
	defer cancel()
	s := h.parked(store)
	rec, err := s.Get(ctx, consumer, key)
	if err != nil {
		return h.notFoundOrUnknown(ctx, store, consumer, err)
	}
	_, perr := s.GetParkedPrefix(ctx, consumer, key, 0)
	if perr != nil && !errors.Is(perr, inbox.ErrNotParked) {
		return perr
	}
	writeJSON(w, http.StatusOK, recordDoc(store, rec, perr == nil))
	return nil
}

// apiForget forgets a key. Its precondition (optional, for scripts) is in
// the query: version (the record's, as GET .../keys/{key} shows it),
// status, uuid (of its parked message).
func (h *handler) apiForget(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	if err := checkParams(q, []string{"store", "tenant", "version", "status", "uuid"}); err != nil {
		return err
	}
	store, err := h.storeOf(q.Get("store"))
	if err != nil {
		return err
	}
	consumer, key, err := keyOf(r, q.Get("tenant"))
	if err != nil {
		return err
	}
	e, err := expectOf(q.Get("version"), q.Get("uuid"), q.Get("status"))
	if err != nil {
		return err
	}
	ctx, cancel := actionCtx(r)
	defer cancel()
	if err := h.forgetOne(ctx, r, store, consumer, key, e); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, map[string]any{"store": store, "consumer": consumer, "key": key, "forgotten": true})
	return nil
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// --- parked messages

func (h *handler) apiParkedList(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	if err := checkParams(q, parkedFields, []string{"limit", "after"}); err != nil {
		return err
	}
	pq, err := h.parkedFilterFrom(q, time.Now())
	if err != nil {
		return err
	}
	limit, err := parseLimit(q.Get("limit"))
	if err != nil {
		return err
	}
	release, err := h.scanSlot(w, pq.scans())
	if err != nil {
		return err
	}
	defer release()
	ctx, cancel := readCtx(r)
	defer cancel()
	page, err := h.parked(pq.Store).FindParked(ctx, pq.Filter, inbox.Page{Limit: limit, After: q.Get("after")})
	if err != nil {
		return err
	}
	if len(page.Messages) == 0 {
		if err := h.unknownConsumer(ctx, pq.Store, pq.Filter.Consumer); err != nil {
			return err
		}
	}
	docs := make([]parkedJSON, len(page.Messages))
	for i, m := range page.Messages {
		docs[i] = parkedDoc(pq.Store, m, false)
	}
	writeJSON(w, http.StatusOK, struct {
		Messages []parkedJSON `json:"messages"`
		Next     string       `json:"next_after,omitempty"`
	}{docs, page.Next})
	return nil
}

// parkedCountJSON is the answer of GET .../parked/count: what a bulk
// action confirms, and when it was counted.
type parkedCountJSON struct {
	Count    int64     `json:"count"`
	Matching string    `json:"matching"`
	AsOf     time.Time `json:"as_of"`
	// Since and Before are the filter's times, resolved (a bulk action
	// takes them so, not relative).
	Since  string `json:"since,omitempty"`
	Before string `json:"before,omitempty"`
}

// countParked counts pq now: the count and its bounds.
func (h *handler) countParked(ctx context.Context, pq parkedQuery) (ops.Confirmation, error) {
	c, err := h.parkedBulk(pq, "", "", false).Count(ctx)
	if err == nil && c.Count == 0 {
		err = h.unknownConsumer(ctx, pq.Store, pq.Filter.Consumer)
	}
	return c, err
}

// parkedBulk is the messages pq matches, for a bulk verb.
func (h *handler) parkedBulk(pq parkedQuery, verb, topic string, forget bool) ops.ParkedBulk {
	return ops.ParkedBulk{Store: h.parked(pq.Store), Filter: pq.Filter, Verb: verb, Topic: topic, Forget: forget}
}

func (h *handler) apiParkedCount(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	if err := checkParams(q, parkedFields); err != nil {
		return err
	}
	pq, err := h.parkedFilterFrom(q, time.Now())
	if err != nil {
		return err
	}
	release, err := h.scanSlot(w, pq.scans())
	if err != nil {
		return err
	}
	defer release()
	ctx, cancel := readCtx(r)
	defer cancel()
	c, err := h.countParked(ctx, pq)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, parkedCountJSON{Count: c.Count, Matching: pq.describe(), AsOf: c.AsOf.UTC(),
		Since: fmtBound(pq.Filter.Since), Before: fmtBound(pq.Filter.Before)})
	return nil
}

func (h *handler) apiParkedGet(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	if err := checkParams(q, []string{"store"}); err != nil {
		return err
	}
	store, err := h.storeOf(q.Get("store"))
	if err != nil {
		return err
	}
	consumer, key, err := keyOf(r, "")
	if err != nil {
		return err
	}
	ctx, cancel := readCtx(r)
	defer cancel()
	m, err := h.parked(store).GetParkedPrefix(ctx, consumer, key, maxShownPayload)
	if err != nil {
		return h.notFoundOrUnknown(ctx, store, consumer, err)
	}
	writeJSON(w, http.StatusOK, parkedDoc(store, m, true))
	return nil
}

// oneBody is the optional JSON body of an action on one message or row:
// its options, and its precondition (what was shown: the version, and for
// a parked message its UUID and the key's status).
type oneBody struct {
	Topic   string `json:"topic"`
	Forget  bool   `json:"forget"`
	Version string `json:"version"`
	UUID    string `json:"uuid"`
	Status  string `json:"status"`
}

func (b oneBody) expect() (inbox.Expect, error) { return expectOf(b.Version, b.UUID, b.Status) }

func (h *handler) apiParkedReplay(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	if err := checkParams(q, []string{"store"}); err != nil {
		return err
	}
	store, err := h.storeOf(q.Get("store"))
	if err != nil {
		return err
	}
	consumer, key, err := keyOf(r, "")
	if err != nil {
		return err
	}
	var b oneBody
	if err := decodeBody(r, &b); err != nil {
		return err
	}
	if b.Forget {
		return badFilter("forget is an option of discard, not of replay")
	}
	if err := checkText("topic", b.Topic); err != nil {
		return err
	}
	e, err := b.expect()
	if err != nil {
		return err
	}
	ctx, cancel := actionCtx(r)
	defer cancel()
	m, err := h.replayOne(ctx, r, store, consumer, key, b.Topic, e)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, map[string]any{"replayed": 1, "message": parkedDoc(store, m, false)})
	return nil
}

func (h *handler) apiParkedDiscard(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	if err := checkParams(q, []string{"store"}); err != nil {
		return err
	}
	store, err := h.storeOf(q.Get("store"))
	if err != nil {
		return err
	}
	consumer, key, err := keyOf(r, "")
	if err != nil {
		return err
	}
	var b oneBody
	if err := decodeBody(r, &b); err != nil {
		return err
	}
	if b.Topic != "" {
		return badFilter("topic is an option of replay, not of discard")
	}
	e, err := b.expect()
	if err != nil {
		return err
	}
	ctx, cancel := actionCtx(r)
	defer cancel()
	if err := h.discardOne(ctx, r, store, consumer, key, b.Forget, e); err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, map[string]any{"discarded": 1, "forgotten": b.Forget})
	return nil
}

// bulkParked is a bulk action on parked messages, as the API and the
// pages run it: the filter, the count the operator confirmed.
type bulkParked struct {
	query  parkedQuery
	topic  string
	forget bool
	all    bool
	expect int64
	asOf   time.Time // the count's
}

// bulkParkedFrom reads a bulk action's JSON body.
func (h *handler) bulkParkedFrom(r *http.Request, verb string) (bulkParked, error) {
	var b bulkBody
	if err := decodeBody(r, &b); err != nil {
		return bulkParked{}, err
	}
	switch {
	case b.Expect == nil:
		return bulkParked{}, badFilter("expect is required: the number of matching messages you confirmed (GET .../parked/count with the same filter)")
	case *b.Expect < 0:
		return bulkParked{}, badFilter("expect is %d: a count is not negative", *b.Expect)
	case b.State != "":
		return bulkParked{}, badFilter("state is a criterion of outbox rows, not of parked messages")
	case b.OrderingKey != "":
		return bulkParked{}, badFilter("ordering_key is a criterion of outbox rows, not of parked messages")
	case verb == "replay" && b.Forget:
		return bulkParked{}, badFilter("forget is an option of discard, not of replay")
	case verb == "discard" && b.Topic != "":
		return bulkParked{}, badFilter("topic is an option of replay, not of discard")
	}
	if b.MaxID != nil {
		return bulkParked{}, badFilter("max_id is a bound of outbox rows, not of parked messages (their count's as_of bounds them)")
	}
	if err := checkText("topic", b.Topic); err != nil {
		return bulkParked{}, err
	}
	pq, err := h.parkedFilterFrom(b.values(), time.Time{})
	if err != nil {
		return bulkParked{}, err
	}
	if err := checkMeta(b.Meta); err != nil {
		return bulkParked{}, err
	}
	if len(b.Meta) > 0 {
		pq.Filter.Metadata = b.Meta
	}
	asOf, err := parseAsOf(b.AsOf)
	if err != nil {
		return bulkParked{}, err
	}
	return bulkParked{query: pq, topic: b.Topic, forget: b.Forget, all: b.All, expect: *b.Expect, asOf: asOf}, nil
}

// runParked runs a bulk action on parked messages through the operator
// layer's protocol (ops.Run), bounded by the count the operator confirmed:
// the messages parked before its as_of that still match; another number
// than the one confirmed is refused, nothing done, with the count now and
// its as_of (count_changed).
func (h *handler) runParked(r *http.Request, verb string, b bulkParked) (res ops.Result, err error) {
	if b.query.empty() && !b.all {
		return res, h.refused(r, badFilter("the filter is empty: it selects every parked message of every consumer; send \"all\": true to mean that"))
	}
	ctx, cancel := actionCtx(r)
	defer cancel()
	defer func() {
		h.audit(r, "parked."+verb+".bulk", err, "store", b.query.Store, "matching", b.query.describe(), "as_of", fmtBound(b.asOf),
			"expected", b.expect, "matched", res.Matched, "count", res.Done, "skipped", res.Skipped, "topic", b.topic, "forget", b.forget)
	}()
	res, err = ops.Run(ctx, h.parkedBulk(b.query, verb, b.topic, b.forget), ops.Confirmation{Count: b.expect, AsOf: b.asOf})
	if err == nil && res.Matched == 0 {
		err = h.unknownConsumer(ctx, b.query.Store, b.query.Filter.Consumer) // nothing confirmed, nothing to do
	}
	return res, bulkErr(err, false)
}

// bulkErr is err of ops.Run as the API answers it: a confirmation no count
// gave is a bad filter; a changed count, count_changed with the count now
// (and its max_id for rows).
func bulkErr(err error, rows bool) error {
	var ce *ops.CountChangedError
	switch {
	case errors.As(err, &ce):
		e := &apiError{status: http.StatusConflict, code: codeCountChanged, count: &ce.Now.Count, asOf: ptr(ce.Now.AsOf.UTC()), message: ce.Error()}
		if rows {
			e.maxID = &ce.Now.MaxID
		}
		return e
	case errors.Is(err, ops.ErrBadConfirmation):
		return badFilter("%s", err)
	}
	return err
}

// stoppedAnswer is the API's answer to a bulk action that stopped
// part-way: the class of its error, with how many it did and the count of
// the rest (recount: the same filter counted now), which a confirmation
// of the same filter goes on with.
func (h *handler) stoppedAnswer(r *http.Request, se *ops.StoppedError, past, one, many string, recount func(context.Context) (resumeJSON, error)) *apiError {
	e := *h.classify(r, se.Err)
	e.done = &se.Done
	e.message = fmt.Sprintf("stopped after %s %s: %s; what was done no longer matches the filter", past, plural(se.Done, one, many), e.message)
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), readTimeout)
	defer cancel()
	if res, err := recount(ctx); err == nil {
		e.resume = &res
		e.message += fmt.Sprintf(": to go on, confirm the %s that still match (resume: its count and bounds) with the same filter", plural(res.Count, one, many))
	} else {
		e.message += ": to go on, count again with the same filter and confirm"
	}
	return &e
}

// parkedResume counts pq again: where a bulk action on it resumes.
func (h *handler) parkedResume(pq parkedQuery) func(context.Context) (resumeJSON, error) {
	return func(ctx context.Context) (resumeJSON, error) {
		c, err := h.countParked(ctx, pq)
		return resumeJSON{Count: c.Count, AsOf: c.AsOf.UTC()}, err
	}
}

func (h *handler) apiParkedBulk(verb string) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error {
		if err := checkParams(r.URL.Query()); err != nil {
			return err
		}
		b, err := h.bulkParkedFrom(r, verb)
		if err != nil {
			return err
		}
		res, err := h.runParked(r, verb, b)
		past := map[string]string{"replay": "replayed", "discard": "discarded"}[verb]
		var se *ops.StoppedError
		if errors.As(err, &se) {
			h.log.Error("exactlyonce console: a bulk action stopped early", "action", "parked."+verb, "done", res.Done, "error", err)
			return h.stoppedAnswer(r, se, past, "message", "messages", h.parkedResume(b.query))
		}
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusOK, map[string]any{"matched": res.Matched, past: res.Done, "skipped": res.Skipped})
		return nil
	}
}

// --- outbox

func (h *handler) apiOutbox(w http.ResponseWriter, r *http.Request) error {
	if err := checkParams(r.URL.Query()); err != nil {
		return err
	}
	if err := h.needDB(); err != nil {
		return err
	}
	snap, refreshing := h.stats.get(r.Context())
	if snap == nil || snap.Outbox == nil {
		msg := "the outbox's figures are being computed: ask again in a moment"
		if snap != nil && len(snap.Errors) > 0 {
			msg = "the outbox's figures could not be computed: " + strings.Join(snap.Errors, "; ")
		}
		return unavailable("%s", msg)
	}
	writeJSON(w, http.StatusOK, struct {
		AsOf       time.Time `json:"as_of"`
		Refreshing bool      `json:"refreshing"`
		*outboxFigures
	}{snap.AsOf, refreshing, snap.Outbox})
	return nil
}

func (h *handler) apiRows(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	if err := checkParams(q, outboxFields, []string{"limit", "after"}); err != nil {
		return err
	}
	if err := h.needDB(); err != nil {
		return err
	}
	oq, err := outboxFilterFrom(q, time.Now())
	if err != nil {
		return err
	}
	oq.Filter = h.boundRows(oq.Filter)
	limit, err := parseLimit(q.Get("limit"))
	if err != nil {
		return err
	}
	var after int64
	if s := q.Get("after"); s != "" {
		if after, err = strconv.ParseInt(s, 10, 64); err != nil || after < 0 {
			return badFilter("after is %q: the next_after of the previous page (a row id)", s)
		}
	}
	release, err := h.scanSlot(w, oq.Filter.Scans())
	if err != nil {
		return err
	}
	defer release()
	ctx, cancel := readCtx(r)
	defer cancel()
	page, err := h.rows.Find(ctx, oq.Filter, rowsPage(after, limit))
	if err != nil {
		return err
	}
	docs := make([]rowJSON, len(page.Rows))
	for i, row := range page.Rows {
		docs[i] = rowDoc(row, false)
	}
	writeJSON(w, http.StatusOK, struct {
		Rows []rowJSON `json:"rows"`
		Next int64     `json:"next_after,omitempty"`
	}{docs, nextRow(page)})
	return nil
}

// rowsCountJSON is the answer of GET .../outbox/rows/count: what a bulk
// action confirms, and its bounds.
type rowsCountJSON struct {
	Count    int64     `json:"count"`
	Matching string    `json:"matching"`
	AsOf     time.Time `json:"as_of"`
	MaxID    int64     `json:"max_id"`
	// Since and Before are the filter's times, resolved (a bulk action
	// takes them so, not relative).
	Since  string `json:"since,omitempty"`
	Before string `json:"before,omitempty"`
}

func (h *handler) apiRowsCount(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	if err := checkParams(q, outboxFields); err != nil {
		return err
	}
	if err := h.needDB(); err != nil {
		return err
	}
	oq, err := outboxFilterFrom(q, time.Now())
	if err != nil {
		return err
	}
	oq.Filter = h.boundRows(oq.Filter)
	release, err := h.scanSlot(w, oq.Filter.Scans())
	if err != nil {
		return err
	}
	defer release()
	ctx, cancel := readCtx(r)
	defer cancel()
	c, err := h.rows.CountAsOf(ctx, oq.Filter)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, rowsCountJSON{Count: c.Count, Matching: oq.describe(), AsOf: c.AsOf.UTC(), MaxID: c.MaxID,
		Since: fmtBound(oq.Filter.QuarantinedSince), Before: fmtBound(oq.Filter.QuarantinedBefore)})
	return nil
}

func rowID(r *http.Request) (int64, error) {
	s := r.PathValue("id")
	id, err := strconv.ParseInt(s, 10, 64)
	if err != nil || id <= 0 {
		return 0, badFilter("row id is %q: a positive number (the id of GET .../outbox/rows)", s)
	}
	return id, nil
}

func (h *handler) apiRow(w http.ResponseWriter, r *http.Request) error {
	if err := checkParams(r.URL.Query()); err != nil {
		return err
	}
	if err := h.needDB(); err != nil {
		return err
	}
	id, err := rowID(r)
	if err != nil {
		return err
	}
	ctx, cancel := readCtx(r)
	defer cancel()
	row, err := h.rows.GetPrefix(ctx, id, maxShownPayload)
	if err != nil {
		return err
	}
	writeJSON(w, http.StatusOK, rowDoc(row, true))
	return nil
}

func (h *handler) apiRowAction(verb string) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error {
		if err := checkParams(r.URL.Query()); err != nil {
			return err
		}
		if err := h.needDB(); err != nil {
			return err
		}
		id, err := rowID(r)
		if err != nil {
			return err
		}
		// The precondition (optional): the row's version, as GET
		// .../outbox/rows/{id} shows it.
		var b struct {
			Version string `json:"version"`
		}
		if err := decodeBody(r, &b); err != nil {
			return err
		}
		if err := checkText("version", b.Version); err != nil {
			return err
		}
		ctx, cancel := actionCtx(r)
		defer cancel()
		if err := h.rowOne(ctx, r, verb, id, outbox.Expect{Version: b.Version}); err != nil {
			return err
		}
		past := map[string]string{"requeue": "requeued", "discard": "discarded"}[verb]
		writeJSON(w, http.StatusOK, map[string]any{past: 1, "id": id})
		return nil
	}
}

// bulkRows is a bulk action on outbox rows: the filter, the count the
// operator confirmed and the bounds of that count.
type bulkRows struct {
	query  outboxQuery
	all    bool
	expect int64
	asOf   time.Time
	maxID  int64
}

func (h *handler) bulkRowsFrom(r *http.Request) (bulkRows, error) {
	var b bulkBody
	if err := decodeBody(r, &b); err != nil {
		return bulkRows{}, err
	}
	switch {
	case b.Expect == nil:
		return bulkRows{}, badFilter("expect is required: the number of matching rows you confirmed (GET .../outbox/rows/count with the same filter)")
	case *b.Expect < 0:
		return bulkRows{}, badFilter("expect is %d: a count is not negative", *b.Expect)
	case b.Store != "" || b.Consumer != "" || b.Key != "" || b.Tenant != "" || b.Forget:
		return bulkRows{}, badFilter("store, consumer, key, tenant and forget are not criteria of outbox rows")
	}
	oq, err := outboxFilterFrom(b.values(), time.Time{})
	if err != nil {
		return bulkRows{}, err
	}
	oq.Filter = h.boundRows(oq.Filter)
	if err := checkMeta(b.Meta); err != nil {
		return bulkRows{}, err
	}
	if len(b.Meta) > 0 {
		oq.Filter.Metadata = b.Meta
	}
	asOf, err := parseAsOf(b.AsOf)
	if err != nil {
		return bulkRows{}, err
	}
	if b.MaxID == nil {
		return bulkRows{}, badFilter("max_id is required: the max_id of the count you confirmed (GET .../outbox/rows/count with the same filter); the action acts on no row written after it")
	}
	if err := (ops.Confirmation{Count: *b.Expect, AsOf: asOf, MaxID: *b.MaxID}).Check(true); err != nil {
		return bulkRows{}, badFilter("%s", err)
	}
	return bulkRows{query: oq, all: b.All, expect: *b.Expect, asOf: asOf, maxID: *b.MaxID}, nil
}

// runRows runs a bulk action on outbox rows through the operator layer's
// protocol (ops.Run), bounded by the count the operator confirmed: the rows
// counted then that still match; another number than the one confirmed is
// refused, nothing done, with the count now and its bounds
// (count_changed).
func (h *handler) runRows(r *http.Request, verb string, b bulkRows) (res ops.Result, err error) {
	if verb == "discard" && b.query.Filter.State != "" && b.query.Filter.State != outbox.StateQuarantined {
		return res, badFilter("state is %q: only quarantined rows can be discarded (a failing row is still the relay's)", b.query.Filter.State)
	}
	if b.query.empty() && !b.all {
		return res, h.refused(r, badFilter("the filter is empty: it selects %s; send \"all\": true to mean that", b.query.describe()))
	}
	ctx, cancel := actionCtx(r)
	defer cancel()
	defer func() {
		h.audit(r, "outbox."+verb+".bulk", err, "matching", b.query.describe(), "as_of", fmtBound(b.asOf), "max_id", b.maxID,
			"expected", b.expect, "matched", res.Matched, "count", res.Done)
	}()
	res, err = ops.Run(ctx, ops.RowsBulk{Rows: h.rows, Filter: b.query.Filter, Verb: verb}, ops.Confirmation{Count: b.expect, AsOf: b.asOf, MaxID: b.maxID})
	return res, bulkErr(err, true)
}

// rowsResume counts oq again: where a bulk action on it resumes.
func (h *handler) rowsResume(oq outboxQuery) func(context.Context) (resumeJSON, error) {
	return func(ctx context.Context) (resumeJSON, error) {
		c, err := h.rows.CountAsOf(ctx, oq.Filter)
		return resumeJSON{Count: c.Count, AsOf: c.AsOf.UTC(), MaxID: &c.MaxID}, err
	}
}

func (h *handler) apiRowsBulk(verb string) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error {
		if err := checkParams(r.URL.Query()); err != nil {
			return err
		}
		if err := h.needDB(); err != nil {
			return err
		}
		b, err := h.bulkRowsFrom(r)
		if err != nil {
			return err
		}
		res, err := h.runRows(r, verb, b)
		past := map[string]string{"requeue": "requeued", "discard": "discarded"}[verb]
		var se *ops.StoppedError
		if errors.As(err, &se) {
			h.log.Error("exactlyonce console: a bulk action stopped early", "action", "outbox."+verb, "done", res.Done, "error", err)
			return h.stoppedAnswer(r, se, past, "row", "rows", h.rowsResume(b.query))
		}
		if err != nil {
			return err
		}
		writeJSON(w, http.StatusOK, map[string]any{"matched": res.Matched, past: res.Done})
		return nil
	}
}

func (h *handler) apiRelays(w http.ResponseWriter, r *http.Request) error {
	if err := checkParams(r.URL.Query()); err != nil {
		return err
	}
	if err := h.needDB(); err != nil {
		return err
	}
	ctx, cancel := readCtx(r)
	defer cancel()
	rs, err := h.relays(ctx)
	if err != nil {
		return err
	}
	// On MySQL the list is not available (available false, and the note
	// says so) and there is no channel: MySQL has no LISTEN.
	channel := ""
	if h.relaysAvailable() {
		channel = notifyChannel(h.cfg.DB)
	}
	writeJSON(w, http.StatusOK, struct {
		Available bool        `json:"available"`
		Channel   string      `json:"channel"`
		Relays    []relayInfo `json:"relays"`
		Note      string      `json:"note"`
	}{h.relaysAvailable(), channel, rs, h.relaysNoteOf()})
	return nil
}

// rowsPage is the outbox page after row id after (0: the first).
func rowsPage(after int64, limit int) outbox.Page {
	p := outbox.Page{Limit: limit}
	if after > 0 {
		p.After = strconv.FormatInt(after, 10)
	}
	return p
}

// nextRow is the id after which the page after page starts; 0 when page is
// the last. outbox.RowPage.Next is a row id.
func nextRow(page outbox.RowPage) int64 {
	n, _ := strconv.ParseInt(page.Next, 10, 64)
	return n
}
