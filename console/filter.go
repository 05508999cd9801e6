package console

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgtext"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// Page sizes.
const (
	defaultLimit = 50
	maxLimit     = 1000
)

// parkedFields are the query parameters of a filter of parked messages.
var parkedFields = []string{"store", "consumer", "key", "uuid", "tenant", "reason", "since", "before", "meta"}

// outboxFields are those of a filter of outbox rows.
var outboxFields = []string{"state", "topic", "uuid", "reason", "since", "before", "meta", "ordering_key"}

// checkParams refuses query parameters that are not in allowed: a
// misspelled filter would silently select more than meant.
func checkParams(q url.Values, allowed ...[]string) error {
	for name := range q {
		known := false
		for _, a := range allowed {
			known = known || slices.Contains(a, name)
		}
		if !known {
			return badFilter("unknown query parameter %q (known: %s)", name, strings.Join(slices.Concat(allowed...), ", "))
		}
	}
	return nil
}

// storeOf checks the store a request names ("" is the first configured:
// PostgreSQL when Config.DB is set).
func (h *handler) storeOf(name string) (string, error) {
	switch {
	case name == "":
		return h.stores[0], nil
	case name == storePostgres && h.pg != nil, name == storeRedis && h.cfg.Redis != nil:
		return name, nil
	case name == storePostgres, name == storeRedis:
		return "", badFilter("store %q is not configured in this console (configured: %s)", name, strings.Join(h.stores, ", "))
	}
	return "", badFilter("store is %q: want %s", name, strings.Join(h.stores, " or "))
}

// parseWhen reads a time bound: RFC 3339 ("2025-11-23T13:00:00Z"), a date
// and time without a zone, taken as UTC ("2025-11-23T13:00", what a
// datetime-local input sends, or with a space), a date (UTC midnight), or
// a duration ago ("90m", "2h", "3d", "1d12h"). A zero now refuses a
// duration: a bulk action takes the absolute times of its count (a
// duration would be resolved again at the time of the action, a window
// that slid since the count).
func parseWhen(field, s string, now time.Time) (time.Time, error) {
	s = strings.TrimSpace(s)
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	for _, layout := range []string{"2006-01-02T15:04:05", "2006-01-02T15:04", "2006-01-02 15:04:05", "2006-01-02 15:04", "2006-01-02"} {
		if t, err := time.ParseInLocation(layout, s, time.UTC); err == nil {
			return t, nil
		}
	}
	if d, err := parseAgo(s); err == nil {
		if now.IsZero() {
			return time.Time{}, badFilter("%s is %q, a time relative to now: a bulk action takes absolute times (RFC 3339), those of its count (its \"since\" and \"before\"), so that it selects what the count did", field, s)
		}
		return now.Add(-d), nil
	}
	return time.Time{}, badFilter("%s is %q: give a time (RFC 3339, 2025-11-23T13:00:00Z; without a zone, UTC) or a duration ago (2h, 3d)", field, s)
}

// maxAgo is the longest duration ago: about 274 years, within what a
// time.Duration holds (a longer one would overflow into the future).
const maxAgo = 100000 * 24 * time.Hour

// parseAgo reads a Go duration with an optional leading number of days,
// at most maxAgo.
func parseAgo(s string) (time.Duration, error) {
	var days time.Duration
	if i := strings.IndexByte(s, 'd'); i > 0 {
		n, err := strconv.Atoi(s[:i])
		if err != nil || n < 0 || n > 100000 {
			return 0, errors.New("bad days")
		}
		days, s = time.Duration(n)*24*time.Hour, s[i+1:]
		if s == "" {
			return days, nil
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 || d > maxAgo-days {
		return 0, errors.New("bad duration")
	}
	return days + d, nil
}

// parseMeta reads metadata criteria: "field:value" (or "field=value":
// the first ':' or '=' separates them), every one required.
func parseMeta(items []string) (map[string]string, error) {
	var out map[string]string
	for _, it := range items {
		if strings.TrimSpace(it) == "" {
			continue
		}
		i := strings.IndexAny(it, ":=")
		if i <= 0 {
			return nil, badFilter("meta is %q: give field:value, a metadata field and its exact value (order_id:A-1042)", it)
		}
		k, v := strings.TrimSpace(it[:i]), it[i+1:]
		if k == "" {
			return nil, badFilter("meta is %q: the field name is empty", it)
		}
		if out == nil {
			out = map[string]string{}
		}
		if old, dup := out[k]; dup && old != v {
			return nil, badFilter("meta names field %q twice with different values: nothing could match", k)
		}
		out[k] = v
	}
	return out, checkMeta(out)
}

func checkMeta(m map[string]string) error {
	for k, v := range m {
		if k == "" {
			return badFilter("meta has an empty field name")
		}
		if err := pgtext.Check(k); err != nil {
			return badFilter("meta field %q: %v", k, err)
		}
		if err := pgtext.Check(v); err != nil {
			return badFilter("meta[%q]: %v", k, err)
		}
	}
	return nil
}

// checkText refuses text no stored value can hold (invalid UTF-8, NUL).
func checkText(field, v string) error {
	if err := pgtext.Check(v); err != nil {
		return badFilter("%s: %v", field, err)
	}
	return nil
}

// parkedQuery is a filter of parked messages and the store it applies to.
type parkedQuery struct {
	Store  string
	Filter inbox.ParkedFilter
}

// parkedFilterFrom reads a filter of parked messages from query or form
// values; relative times are resolved against now.
func (h *handler) parkedFilterFrom(v url.Values, now time.Time) (parkedQuery, error) {
	store, err := h.storeOf(v.Get("store"))
	if err != nil {
		return parkedQuery{}, err
	}
	f := inbox.ParkedFilter{Consumer: v.Get("consumer"), Key: v.Get("key"), MessageUUID: strings.TrimSpace(v.Get("uuid")),
		Tenant: v.Get("tenant"), Reason: v.Get("reason")}
	for _, c := range []struct{ name, v string }{{"consumer", f.Consumer}, {"key", f.Key}, {"uuid", f.MessageUUID}, {"tenant", f.Tenant}, {"reason", f.Reason}} {
		if err := checkText(c.name, c.v); err != nil {
			return parkedQuery{}, err
		}
	}
	if f.Since, err = parseWhen("since", v.Get("since"), now); err != nil {
		return parkedQuery{}, err
	}
	if f.Before, err = parseWhen("before", v.Get("before"), now); err != nil {
		return parkedQuery{}, err
	}
	if !f.Since.IsZero() && !f.Before.IsZero() && !f.Before.After(f.Since) {
		return parkedQuery{}, badFilter("before (%s) must be after since (%s)", f.Before.Format(time.RFC3339), f.Since.Format(time.RFC3339))
	}
	if f.Metadata, err = parseMeta(v["meta"]); err != nil {
		return parkedQuery{}, err
	}
	if store == storeRedis && f.Consumer == "" {
		return parkedQuery{}, badFilter("consumer is required with store=redis: the Redis store keeps parked messages per consumer")
	}
	// The console's bounds (Config.MaxScan, MaxCount): a search or count
	// over them is refused by the store (too_broad), a bulk action's count
	// too.
	f.MaxScan, f.MaxCount = h.cfg.MaxScan, h.cfg.MaxCount
	return parkedQuery{Store: store, Filter: f}, nil
}

// scans reports whether a read of q searches by a condition no index
// serves: a reason, a tenant or a key without the consumer, and any read
// of the Redis store (which reads each of the consumer's parked keys).
func (q parkedQuery) scans() bool { return q.Store == storeRedis || q.Filter.Scans() }

// boundRows is f with the console's bounds (Config.MaxScan, MaxCount).
func (h *handler) boundRows(f outbox.RowFilter) outbox.RowFilter {
	f.MaxScan, f.MaxCount = h.cfg.MaxScan, h.cfg.MaxCount
	return f
}

// scanSlot takes one of the Config.MaxConcurrentScans tokens of the
// searches and counts by a condition no index serves, when scans is true
// (else it takes none), and returns its release. When all are taken it
// answers 429 "busy" with Retry-After: such a read is bounded
// (Config.MaxScan) but not free, and a crowd of them would queue on the
// database's connections, which the service shares.
func (h *handler) scanSlot(w http.ResponseWriter, scans bool) (release func(), err error) {
	if !scans {
		return func() {}, nil
	}
	select {
	case h.scans <- struct{}{}:
	default:
		w.Header().Set("Retry-After", "1")
		return nil, &apiError{status: http.StatusTooManyRequests, code: codeBusy,
			message: fmt.Sprintf("busy: %d searches by text (a reason, a tenant or a key without its consumer, the Redis store) are under way, "+
				"the most this console runs at once (Config.MaxConcurrentScans): try again in a moment, or narrow the search by a consumer, "+
				"a business id or a message UUID (those need no token)", cap(h.scans))}
	}
	if h.scanning != nil {
		h.scanning()
	}
	return func() { <-h.scans }, nil
}

// values is q as query values (times in RFC 3339): what a link or a form
// carries to select the same messages.
func (q parkedQuery) values() url.Values {
	v := url.Values{}
	set := func(k, s string) {
		if s != "" {
			v.Set(k, s)
		}
	}
	set("store", q.Store)
	f := q.Filter
	set("consumer", f.Consumer)
	set("key", f.Key)
	set("uuid", f.MessageUUID)
	set("tenant", f.Tenant)
	set("reason", f.Reason)
	set("since", fmtBound(f.Since))
	set("before", fmtBound(f.Before))
	for _, k := range slices.Sorted(maps.Keys(f.Metadata)) {
		v.Add("meta", k+":"+f.Metadata[k])
	}
	return v
}

func fmtBound(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	return t.UTC().Format(time.RFC3339Nano)
}

// empty reports whether q selects every parked message (of every
// consumer, with PostgreSQL).
func (q parkedQuery) empty() bool {
	f := q.Filter
	return f.Consumer == "" && f.Key == "" && f.MessageUUID == "" && f.Tenant == "" && f.Reason == "" &&
		f.Since.IsZero() && f.Before.IsZero() && len(f.Metadata) == 0
}

// describe says in words what q selects.
func (q parkedQuery) describe() string {
	f := q.Filter
	var parts []string
	add := func(name, v string) {
		if v != "" {
			parts = append(parts, name+" "+strconv.Quote(v))
		}
	}
	add("consumer", f.Consumer)
	add("key", f.Key)
	add("message UUID", f.MessageUUID)
	add("tenant", f.Tenant)
	add("reason containing", f.Reason)
	for _, k := range slices.Sorted(maps.Keys(f.Metadata)) {
		parts = append(parts, "metadata "+strconv.Quote(k)+" = "+strconv.Quote(f.Metadata[k]))
	}
	if !f.Since.IsZero() {
		parts = append(parts, "parked at or after "+fmtBound(f.Since))
	}
	if !f.Before.IsZero() {
		parts = append(parts, "parked before "+fmtBound(f.Before))
	}
	where := "the PostgreSQL inbox"
	if q.Store == storeRedis {
		where = "the Redis store"
	}
	if len(parts) == 0 {
		return "every parked message in " + where
	}
	return "parked messages in " + where + " with " + strings.Join(parts, ", ")
}

// parseLimit reads a page's size: defaultLimit for "", at most maxLimit.
func parseLimit(s string) (int, error) {
	if s == "" {
		return defaultLimit, nil
	}
	n, err := strconv.Atoi(s)
	switch {
	case err != nil || n < 1:
		return 0, badFilter("limit is %q: a number of rows from 1 to %d", s, maxLimit)
	case n > maxLimit:
		return 0, &apiError{status: http.StatusBadRequest, code: codePageTooLarge,
			message: fmt.Sprintf("limit is %d: a page holds at most %d; read the next with after", n, maxLimit)}
	}
	return n, nil
}

// outboxQuery is a filter of outbox rows.
type outboxQuery struct {
	Filter outbox.RowFilter
}

// outboxFilterFrom reads a filter of outbox rows from query or form
// values.
func outboxFilterFrom(v url.Values, now time.Time) (outboxQuery, error) {
	f := outbox.RowFilter{State: outbox.RowState(v.Get("state")), Topic: v.Get("topic"), UUID: strings.TrimSpace(v.Get("uuid")), Reason: v.Get("reason"),
		OrderingKey: v.Get("ordering_key")}
	switch f.State {
	case "", outbox.StateQuarantined, outbox.StateFailing, outbox.StateAll:
	default:
		return outboxQuery{}, badFilter("state is %q: want quarantined (the default), failing or all", f.State)
	}
	for _, c := range []struct{ name, v string }{{"topic", f.Topic}, {"uuid", f.UUID}, {"reason", f.Reason}, {"ordering_key", f.OrderingKey}} {
		if err := checkText(c.name, c.v); err != nil {
			return outboxQuery{}, err
		}
	}
	var err error
	if f.QuarantinedSince, err = parseWhen("since", v.Get("since"), now); err != nil {
		return outboxQuery{}, err
	}
	if f.QuarantinedBefore, err = parseWhen("before", v.Get("before"), now); err != nil {
		return outboxQuery{}, err
	}
	if f.State == outbox.StateFailing && (!f.QuarantinedSince.IsZero() || !f.QuarantinedBefore.IsZero()) {
		return outboxQuery{}, badFilter("since and before select by quarantine time: failing rows are not quarantined (state=failing with a time range matches nothing)")
	}
	if !f.QuarantinedSince.IsZero() && !f.QuarantinedBefore.IsZero() && !f.QuarantinedSince.Before(f.QuarantinedBefore) {
		return outboxQuery{}, badFilter("before (%s) must be after since (%s)", fmtBound(f.QuarantinedBefore), fmtBound(f.QuarantinedSince))
	}
	if f.Metadata, err = parseMeta(v["meta"]); err != nil {
		return outboxQuery{}, err
	}
	return outboxQuery{Filter: f}, nil
}

func (q outboxQuery) values() url.Values {
	v := url.Values{}
	set := func(k, s string) {
		if s != "" {
			v.Set(k, s)
		}
	}
	f := q.Filter
	set("state", string(f.State))
	set("topic", f.Topic)
	set("uuid", f.UUID)
	set("reason", f.Reason)
	set("ordering_key", f.OrderingKey)
	set("since", fmtBound(f.QuarantinedSince))
	set("before", fmtBound(f.QuarantinedBefore))
	for _, k := range slices.Sorted(maps.Keys(f.Metadata)) {
		v.Add("meta", k+":"+f.Metadata[k])
	}
	return v
}

func (q outboxQuery) empty() bool {
	f := q.Filter
	return f.Topic == "" && f.UUID == "" && f.Reason == "" && f.OrderingKey == "" && f.QuarantinedSince.IsZero() && f.QuarantinedBefore.IsZero() && len(f.Metadata) == 0
}

func (q outboxQuery) describe() string {
	f := q.Filter
	state := string(f.State)
	if state == "" {
		state = string(outbox.StateQuarantined)
	}
	var parts []string
	add := func(name, v string) {
		if v != "" {
			parts = append(parts, name+" "+strconv.Quote(v))
		}
	}
	add("topic", f.Topic)
	add("message UUID", f.UUID)
	add("last error containing", f.Reason)
	add("ordering key", f.OrderingKey)
	for _, k := range slices.Sorted(maps.Keys(f.Metadata)) {
		parts = append(parts, "metadata "+strconv.Quote(k)+" = "+strconv.Quote(f.Metadata[k]))
	}
	if !f.QuarantinedSince.IsZero() {
		parts = append(parts, "quarantined at or after "+fmtBound(f.QuarantinedSince))
	}
	if !f.QuarantinedBefore.IsZero() {
		parts = append(parts, "quarantined before "+fmtBound(f.QuarantinedBefore))
	}
	what := map[string]string{"quarantined": "quarantined", "failing": "failing", "all": "quarantined or failing"}[state]
	if len(parts) == 0 {
		return "every " + what + " outbox row"
	}
	return what + " outbox rows with " + strings.Join(parts, ", ")
}

// bulkBody is the JSON body of a bulk action: the filter (the query
// parameters' names; meta an object of exact values), what to do, and
// the count the caller confirmed.
type bulkBody struct {
	Store       string            `json:"store"`
	Consumer    string            `json:"consumer"`
	Key         string            `json:"key"`
	UUID        string            `json:"uuid"`
	Tenant      string            `json:"tenant"`
	Reason      string            `json:"reason"`
	Since       string            `json:"since"`
	Before      string            `json:"before"`
	Meta        map[string]string `json:"meta"`
	State       string            `json:"state"`
	Topic       string            `json:"topic"`
	OrderingKey string            `json:"ordering_key"`
	Forget      bool              `json:"forget"`
	All         bool              `json:"all"`
	Expect      *int64            `json:"expect"`
	// AsOf and MaxID are the bounds of the count that Expect confirms
	// (its "as_of" and, for outbox rows, "max_id"): the action selects
	// nothing the count could not see.
	AsOf  string `json:"as_of"`
	MaxID *int64 `json:"max_id"`
}

// parseAsOf reads the as_of of a count that a bulk action carries: an
// absolute time, required.
func parseAsOf(s string) (time.Time, error) {
	if strings.TrimSpace(s) == "" {
		return time.Time{}, badFilter("as_of is required: the as_of of the count you confirmed (GET .../count with the same filter); the action acts on nothing the count could not see")
	}
	return parseWhen("as_of", s, time.Time{})
}

// values is the body's filter as query values, for the filters' parsers;
// its metadata criteria are b.Meta, set apart (a field name may hold ':').
func (b bulkBody) values() url.Values {
	v := url.Values{}
	for k, s := range map[string]string{"store": b.Store, "consumer": b.Consumer, "key": b.Key, "uuid": b.UUID, "tenant": b.Tenant,
		"reason": b.Reason, "since": b.Since, "before": b.Before, "state": b.State, "topic": b.Topic, "ordering_key": b.OrderingKey} {
		if s != "" {
			v.Set(k, s)
		}
	}
	return v
}

// decodeBody reads a JSON body into v, refusing unknown fields (a
// misspelled criterion would select more than meant) and trailing data.
// An empty body is the zero value.
func decodeBody(r *http.Request, v any) error {
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var mbe *http.MaxBytesError
		switch {
		case errors.Is(err, io.EOF):
			return nil
		case errors.As(err, &mbe):
			return err
		}
		return badFilter("the request's body is not the JSON expected: %v", err)
	}
	if dec.More() {
		return badFilter("the request's body holds more than one JSON value")
	}
	return nil
}
