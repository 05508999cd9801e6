package console

import (
	"bytes"
	"embed"
	"errors"
	"fmt"
	"html/template"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/ops"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

//go:embed templates/*.html static/*
var assets embed.FS

// pageNames are the templates of the pages, each a file of templates/
// that defines "content" for templates/layout.html.
var pageNames = []string{"overview", "parked", "message", "outbox", "row", "inbox", "confirm", "result", "notice", "login"}

var parsePages = sync.OnceValues(func() (map[string]*template.Template, error) {
	base, err := template.New("layout.html").Funcs(funcs).ParseFS(assets, "templates/layout.html")
	if err != nil {
		return nil, err
	}
	pages := map[string]*template.Template{}
	for _, name := range pageNames {
		t, err := template.Must(base.Clone()).ParseFS(assets, "templates/"+name+".html")
		if err != nil {
			return nil, err
		}
		pages[name] = t
	}
	return pages, nil
})

var funcs = template.FuncMap{
	"num":     fmtNum,
	"when":    fmtWhen,
	"iso":     fmtISO,
	"ago":     fmtAgo,
	"seconds": fmtSeconds,
	"seg":     seg,
	// keyState is a key's status as shown (ops.KeyState: "no record"
	// for none).
	"keyState": ops.KeyState,
}

// pageData is what every page gets; Data is the page's own.
type pageData struct {
	Title    string
	Prefix   string
	User     string
	ReadOnly bool
	Logout   bool
	Nav      string
	Script   bool
	Stores   []string
	// MySQL: the SQL store is on MySQL/MariaDB (its name, StoreName).
	MySQL bool
	Data  any
}

// StoreName is how a page names a store: the SQL store ("postgres", the
// store's identifier in URLs and the API) as "mysql" on MySQL/MariaDB.
func (p pageData) StoreName(store string) string {
	if p.MySQL && store == storePostgres {
		return "mysql"
	}
	return store
}

// SQLInbox is the label of the SQL store in the store pickers.
func (p pageData) SQLInbox() string {
	if p.MySQL {
		return "MySQL inbox"
	}
	return "PostgreSQL inbox"
}

// render writes the page.
func (h *handler) render(w http.ResponseWriter, r *http.Request, status int, page, title string, data any) {
	t := h.pages[page]
	_, bearer := h.cfg.Auth.(*bearerAuth)
	pd := pageData{Title: title, Prefix: h.prefix, User: userOf(r), ReadOnly: h.cfg.ReadOnly, Logout: bearer && userOf(r) != "",
		Nav: page, Script: page == "overview", Stores: h.stores, MySQL: h.cfg.DB.Dialect == sqlschema.MySQL, Data: data}
	var buf bytes.Buffer
	if err := t.ExecuteTemplate(&buf, "layout.html", pd); err != nil {
		h.log.Error("exactlyonce console: rendering a page", "page", page, "error", err)
		http.Error(w, "internal error rendering the page", http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = buf.WriteTo(w)
}

// seg escapes a path segment: a key may hold '/', '?', '%', or be "."
// (which a mux would clean away).
func seg(s string) string {
	e := url.PathEscape(s)
	if e == "." || e == ".." {
		return strings.ReplaceAll(e, ".", "%2E")
	}
	return e
}

func fmtNum(n *int64) string {
	if n == nil {
		return "not counted"
	}
	return strconv.FormatInt(*n, 10)
}

func timeOf(v any) (time.Time, bool) {
	switch t := v.(type) {
	case time.Time:
		return t, !t.IsZero()
	case *time.Time:
		if t != nil {
			return *t, !t.IsZero()
		}
	}
	return time.Time{}, false
}

func fmtWhen(v any) string {
	t, ok := timeOf(v)
	if !ok {
		return "never"
	}
	return t.UTC().Format("2006-01-02 15:04:05Z")
}

func fmtISO(v any) string {
	t, ok := timeOf(v)
	if !ok {
		return ""
	}
	return t.UTC().Format(time.RFC3339)
}

func fmtAgo(v any) string {
	t, ok := timeOf(v)
	if !ok {
		return ""
	}
	return fmtDuration(time.Since(t)) + " ago"
}

func fmtSeconds(s *float64) string {
	if s == nil {
		return "none pending"
	}
	return fmtDuration(time.Duration(*s * float64(time.Second)))
}

// fmtDuration is d rounded for a person: 4.3s, 12m, 3h20m, 41d.
func fmtDuration(d time.Duration) string {
	switch {
	case d < 0:
		return "0s"
	case d < 10*time.Second:
		return strconv.FormatFloat(d.Seconds(), 'f', 1, 64) + "s"
	case d < time.Minute:
		return strconv.Itoa(int(d.Seconds())) + "s"
	case d < time.Hour:
		return strconv.Itoa(int(d.Minutes())) + "m"
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh%dm", int(d.Hours()), int(d.Minutes())%60)
	}
	return strconv.Itoa(int(d.Hours()/24)) + "d"
}

func plural(n int64, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return strconv.FormatInt(n, 10) + " " + many
}

// field is a hidden input of a form.
type field struct{ Name, Value string }

func fieldsOf(v url.Values) []field {
	var out []field
	for _, k := range slices.Sorted(maps.Keys(v)) {
		for _, s := range v[k] {
			out = append(out, field{k, s})
		}
	}
	return out
}

// payloadView is a payload as a page shows it: UTF-8 text as it is
// (escaped by the template), or base64 with a note; Truncated, when only
// its first bytes are shown, says so and how to read the rest.
type payloadView struct {
	Text      string
	Note      string
	Binary    bool
	Truncated string
}

// payloadViewOf is the view of p, the payload read with a bounded prefix
// (maxShownPayload) of a payload of size bytes: all of it unless p is
// shorter. whole is the command that prints the whole payload.
func payloadViewOf(p []byte, kept bool, size int, whole string) payloadView {
	if !kept {
		return payloadView{Note: fmt.Sprintf("The payload (%d bytes) was not kept: it was larger than the middleware keeps. Re-publish it from its source, then release the key.", size)}
	}
	text, binary, shown := shownPayload(p, size)
	v := payloadView{Text: text, Binary: binary, Note: fmt.Sprintf("%d bytes, UTF-8 text.", size)}
	if binary {
		v.Note = fmt.Sprintf("%d bytes, not UTF-8 text: shown as base64.", size)
	}
	if shown < size {
		kind := "UTF-8 text"
		if binary {
			kind = "not UTF-8 text: shown as base64"
		}
		v.Note = fmt.Sprintf("Showing the first %d of %d bytes (%s).", shown, size, kind)
		v.Truncated = fmt.Sprintf("%d more bytes not shown: the console shows at most the first %d bytes of a payload. %s prints all of it.",
			size-shown, maxShownPayload, whole)
	}
	return v
}

// shellQuote is s as one word of a POSIX shell: as it is when it holds
// only characters no shell treats specially, else in single quotes.
func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:/@%+=,-") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

type metaEntry struct{ Key, Value string }

func metaEntries(m map[string]string) []metaEntry {
	out := make([]metaEntry, 0, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		out = append(out, metaEntry{k, m[k]})
	}
	return out
}

// --- data of the pages

type noticeData struct {
	Heading   string
	Text      string
	Consumers []string
}

type loginData struct {
	Next   string
	Failed bool
}

type overviewData struct {
	AsOf       *time.Time
	Refreshing bool
	Interval   string
	Consumers  []consumerRow
	More       bool
	Outbox     *outboxFigures
	Relays     []relayInfo
	RelaysNote string
	// NoRelays: the list of relays is not available (MySQL).
	NoRelays bool
	Errors   []string
	DB       bool
}

type consumerRow struct {
	consumerFigures
	ParkedURL string
}

type parkedFormValues struct {
	Store, Consumer, Key, UUID, Tenant, Reason, Since, Before string
	Meta                                                      []string
}

// parkedRowView is a row of the parked list: its fields as the template
// shows them, flat (a field reached through an embedded struct costs the
// template a reflective search per row; a page holds up to 1,000) and the
// times formatted once.
type parkedRowView struct {
	Consumer, Key, UUID, Status, Reason string
	Attempts                            int
	ParkedISO, ParkedAgo                string
	URL                                 string
}

func parkedRowOf(m inbox.ParkedMessage, url string) parkedRowView {
	return parkedRowView{Consumer: m.Consumer, Key: m.Key, UUID: m.UUID, Status: m.Status, Reason: m.Reason, Attempts: m.Attempts,
		ParkedISO: fmtISO(m.ParkedAt), ParkedAgo: fmtAgo(m.ParkedAt), URL: url}
}

type parkedListData struct {
	Form     parkedFormValues
	Searched bool
	Error    string
	Count    int64
	Matching string
	Messages []parkedRowView
	NextURL  string
	Bulk     []field
	Store    string

	// CountOver, when not 0, is the bound (Config.MaxCount) the count is
	// over: the page says "more than" it and offers no bulk action.
	CountOver int
}

type messageData struct {
	Store      string
	M          inbox.ParkedMessage
	Payload    payloadView
	Metadata   []metaEntry
	ReplayURL  string
	DiscardURL string
	InboxURL   string
}

type confirmData struct {
	Heading   string
	Count     string // "This replays 37 messages."
	Matching  string
	Changed   string
	Action    string
	Fields    []field
	Button    string
	CancelURL string
	Zero      bool
	Note      string
	Danger    bool
}

type resultData struct {
	Heading string
	Text    string
	OK      bool
	Details []string
	BackURL string
	Back    string
}

type outboxFormValues struct {
	State, Topic, UUID, Reason, Since, Before, OrderingKey string
	Meta                                                   []string
}

// rowView is a row of the outbox list: its fields as the template shows
// them, flat (see parkedRowView).
type rowView struct {
	ID                          int64
	Topic, UUID, LastError      string
	OrderingKey                 string
	Waiting                     int64
	Failures, PermanentFailures int
	State                       string
	URL                         string
	KeyURL                      string // the failed rows of its ordering key; "" when none
}

type outboxListData struct {
	Form     outboxFormValues
	Figures  *outboxFigures
	AsOf     *time.Time
	Error    string
	Count    int64
	Matching string
	Rows     []rowView
	NextURL  string
	Bulk     []field
	Discard  bool

	// CountOver: as parkedListData's.
	CountOver int
}

type rowData struct {
	Row         outbox.Row
	KeyURL      string // the failed rows of its ordering key; "" when none
	State       string
	Payload     payloadView
	Metadata    []metaEntry
	RequeueURL  string
	DiscardURL  string
	Quarantined bool
}

type inboxData struct {
	Store, Consumer, Key, Tenant string
	Searched                     bool
	Error                        string
	Record                       *recordJSON
	ParkedURL                    string
}

// --- handlers

func (h *handler) messageURL(store, consumer, key string) string {
	u := h.prefix + "/parked/" + seg(consumer) + "/" + seg(key)
	if store == storeRedis {
		u += "?store=redis"
	}
	return u
}

func (h *handler) pageOverview(w http.ResponseWriter, r *http.Request) error {
	snap, refreshing := h.stats.get(r.Context())
	d := overviewData{Refreshing: refreshing, Interval: h.cfg.StatsInterval.String(), DB: h.pg != nil}
	if h.pg != nil {
		d.RelaysNote, d.NoRelays = h.relaysNoteOf(), !h.relaysAvailable()
	}
	if snap != nil {
		d.AsOf, d.More, d.Outbox, d.Relays, d.Errors = &snap.AsOf, snap.ConsumersMore, snap.Outbox, snap.Relays, snap.Errors
		for _, c := range snap.Consumers {
			v := url.Values{"consumer": {c.Consumer}}
			if c.Store == storeRedis {
				v.Set("store", storeRedis)
			}
			d.Consumers = append(d.Consumers, consumerRow{c, h.prefix + "/parked?" + v.Encode()})
		}
	}
	h.render(w, r, http.StatusOK, "overview", "Overview", d)
	return nil
}

func parkedForm(v url.Values) parkedFormValues {
	return parkedFormValues{Store: v.Get("store"), Consumer: v.Get("consumer"), Key: v.Get("key"), UUID: v.Get("uuid"), Tenant: v.Get("tenant"),
		Reason: v.Get("reason"), Since: v.Get("since"), Before: v.Get("before"), Meta: v["meta"]}
}

func (h *handler) pageParked(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	d := parkedListData{Form: parkedForm(q)}
	for name, vs := range q {
		if slices.Contains(parkedFields, name) && slices.ContainsFunc(vs, func(s string) bool { return s != "" }) {
			d.Searched = true
		}
	}
	if !d.Searched && len(h.stores) == 1 && h.stores[0] == storeRedis {
		d.Error = "Name a consumer: the Redis store keeps parked messages per consumer."
		h.render(w, r, http.StatusOK, "parked", "Parked messages", d)
		return nil
	}
	pq, err := h.parkedFilterFrom(q, time.Now())
	if err == nil {
		err = checkParams(q, parkedFields, []string{"limit", "after"})
	}
	limit := defaultLimit
	if err == nil {
		limit, err = parseLimit(q.Get("limit"))
	}
	var release func()
	if err == nil {
		release, err = h.scanSlot(w, pq.scans())
	}
	if err != nil {
		e := h.classify(r, err)
		d.Error = e.message
		h.render(w, r, e.status, "parked", "Parked messages", d)
		return nil
	}
	defer release()
	ctx, cancel := readCtx(r)
	defer cancel()
	s := h.parked(pq.Store)
	page, err := s.FindParked(ctx, pq.Filter, inbox.Page{Limit: limit, After: q.Get("after")})
	if err == nil {
		d.Count, err = s.CountParked(ctx, pq.Filter)
		if errors.Is(err, inbox.ErrTooBroad) && len(page.Messages) > 0 {
			// The page is shown; the count (and a bulk action) is not.
			d.Count, d.CountOver, err = 0, h.cfg.MaxCount, nil
		}
	}
	if err == nil && d.Count == 0 && d.CountOver == 0 {
		err = h.unknownConsumer(ctx, pq.Store, pq.Filter.Consumer)
	}
	if err != nil {
		e := h.classify(r, err)
		d.Error = e.message
		if len(e.consumers) > 0 {
			d.Error += "."
		}
		h.render(w, r, e.status, "parked", "Parked messages", d)
		return nil
	}
	d.Store, d.Matching = pq.Store, pq.describe()
	for _, m := range page.Messages {
		d.Messages = append(d.Messages, parkedRowOf(m, h.messageURL(pq.Store, m.Consumer, m.Key)))
	}
	if page.Next != "" {
		v := pq.values()
		v.Set("after", page.Next)
		if limit != defaultLimit {
			v.Set("limit", strconv.Itoa(limit))
		}
		d.NextURL = h.prefix + "/parked?" + v.Encode()
	}
	d.Bulk = fieldsOf(pq.values())
	h.render(w, r, http.StatusOK, "parked", "Parked messages", d)
	return nil
}

func (h *handler) pageMessage(w http.ResponseWriter, r *http.Request) error {
	store, err := h.storeOf(r.URL.Query().Get("store"))
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
	base := h.prefix + "/parked/" + seg(consumer) + "/" + seg(key)
	v := url.Values{"consumer": {consumer}, "key": {key}}
	if store == storeRedis {
		v.Set("store", storeRedis)
	}
	whole := "exactlyonce parked show --full-payload " + shellQuote(consumer) + " " + shellQuote(key)
	if store == storeRedis {
		whole = "exactlyonce parked --redis-url URL show --full-payload " + shellQuote(consumer) + " " + shellQuote(key)
	}
	d := messageData{Store: store, M: m, Payload: payloadViewOf(m.Payload, m.PayloadKept, m.PayloadSize, whole), Metadata: metaEntries(m.Metadata),
		ReplayURL: base + "/replay", DiscardURL: base + "/discard", InboxURL: h.prefix + "/inbox?" + v.Encode()}
	h.render(w, r, http.StatusOK, "message", "Parked message", d)
	return nil
}

// confirmed reads the confirmation of a form: whether it was confirmed,
// and the count confirmed.
func confirmed(r *http.Request) (bool, int64, error) {
	if r.PostFormValue("confirmed") != "1" {
		return false, 0, nil
	}
	n, err := strconv.ParseInt(r.PostFormValue("expect"), 10, 64)
	if err != nil || n < 0 {
		return false, 0, badFilter("expect is %q: the count you confirmed", r.PostFormValue("expect"))
	}
	return true, n, nil
}

func (h *handler) pageParkedOne(verb string) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error {
		if err := r.ParseForm(); err != nil {
			return badFilter("the form: %v", err)
		}
		store, err := h.storeOf(r.PostFormValue("store"))
		if err != nil {
			return err
		}
		consumer, key, err := keyOf(r, "")
		if err != nil {
			return err
		}
		topic, forget := strings.TrimSpace(r.PostFormValue("topic")), r.PostFormValue("forget") == "1"
		if err := checkText("topic", topic); err != nil {
			return err
		}
		// A discard's confirmation carries the key's status too: what a
		// discard that keeps the key does depends on it (a parked key
		// becomes discarded, its late copies dropped; a released one stays
		// failed, its next delivery runs), and the confirmation said which.
		shown, err := expectOf(r.PostFormValue("version"), r.PostFormValue("uuid"), r.PostFormValue("status"))
		if err != nil {
			return err
		}
		ok, expect, err := confirmed(r)
		if err != nil {
			return err
		}
		back := h.messageURL(store, consumer, key)
		if !ok {
			ctx, cancel := readCtx(r)
			defer cancel()
			m, err := h.parked(store).GetParkedPrefix(ctx, consumer, key, 0)
			if err != nil {
				return h.notFoundOrUnknown(ctx, store, consumer, err)
			}
			// The confirmation shows the message as it is now; one that is
			// not the message of the page the operator came from is refused.
			if shown.Version != "" && shown.Version != m.Version {
				return h.changedPage(w, r, "Changed since you opened it",
					fmt.Sprintf("The parked message of consumer %q, key %q is now message %s, parked %s, status %s: not the one the page showed.",
						m.Consumer, m.Key, m.UUID, fmtWhen(m.ParkedAt), ops.KeyState(m.Status)), back)
			}
			fields := []field{{"store", store}, {"expect", "1"}, {"confirmed", "1"}, {"version", m.Version}, {"uuid", m.UUID}}
			d := confirmData{Action: h.prefix + "/parked/" + seg(consumer) + "/" + seg(key) + "/" + verb, CancelURL: back,
				Matching: fmt.Sprintf("The parked message of consumer %q, key %q (message %s).", m.Consumer, m.Key, m.UUID)}
			if verb == "replay" {
				to := m.Topic
				if topic != "" {
					to = topic
					fields = append(fields, field{"topic", topic})
				}
				d.Heading, d.Count, d.Button = "Replay a parked message", "This replays 1 message.", "Replay 1 message"
				d.Note = replayNote(store, to)
			} else {
				if forget {
					fields = append(fields, field{"forget", "1"})
				}
				fields = append(fields, field{"status", m.Status})
				d.Heading, d.Count, d.Button, d.Danger = "Discard a parked message", "This discards 1 message.", "Discard 1 message", true
				d.Note = discardNote(forget, m.Status)
			}
			d.Fields = fields
			h.render(w, r, http.StatusOK, "confirm", d.Heading, d)
			return nil
		}
		if expect != 1 {
			return badFilter("expect is %d: an action on one message confirms 1", expect)
		}
		if shown.Version == "" {
			return badFilter("the confirmation carries the version of the message it showed, and this one has none: open the message again")
		}
		ctx, cancel := actionCtx(r)
		defer cancel()
		res := resultData{BackURL: h.prefix + "/parked", Back: "Back to the parked messages"}
		if verb == "replay" {
			m, err := h.replayOne(ctx, r, store, consumer, key, topic, shown)
			if err != nil {
				return h.actionFailed(w, r, "Not replayed", err, back)
			}
			res.Heading, res.OK = "Replayed", true
			res.Text = fmt.Sprintf("Replayed 1 message: %s.", replayDone(store, m.Topic))
		} else {
			if err := h.discardOne(ctx, r, store, consumer, key, forget, shown); err != nil {
				return h.actionFailed(w, r, "Not discarded", err, back)
			}
			res.Heading, res.OK, res.Text = "Discarded", true, "Discarded 1 message."
			if forget {
				res.Text = "Discarded 1 message and forgot its key: its next delivery runs the handler."
			}
		}
		h.render(w, r, http.StatusOK, "result", res.Heading, res)
		return nil
	}
}

func replayNote(store, topic string) string {
	if store == storeRedis {
		return fmt.Sprintf("The key is released and the message published again, with its UUID, to %q through the console's publisher; the consumer runs it once.", topic)
	}
	return fmt.Sprintf("The key is released and the message written to the outbox for topic %q, with its UUID, in one transaction; the relay publishes it and the consumer runs it once.", topic)
}

func replayDone(store, topic string) string {
	if store == storeRedis {
		return fmt.Sprintf("published to %q", topic)
	}
	return fmt.Sprintf("written to the outbox for topic %q; the relay publishes it", topic)
}

// discardNote says what the discard of one message does to its key, whose
// status is status (the confirmation carries it: a key whose status
// changed before the confirm is refused).
func discardNote(forget bool, status string) string {
	switch {
	case forget && (status == "parked" || status == "failed"):
		return "The kept message is deleted and its key forgotten: the key's next delivery runs the handler. This cannot be undone."
	case status == "parked":
		return "The kept message is deleted; its key stays recorded, as discarded, so a late redelivery is still not run. This cannot be undone."
	case status == "failed":
		return "The kept message is deleted; its key stays released (failed): its next delivery runs the handler. This cannot be undone."
	case status == "":
		return "The kept message is deleted; its key has no record: its next delivery runs the handler. This cannot be undone."
	}
	// done or processing: processed since, or an attempt holds it.
	return fmt.Sprintf("The kept message is deleted; its key stays %s, as it is (a discard changes a parked or released key only). This cannot be undone.", status)
}

// discardBulkNote says what a bulk discard does to the keys, whatever
// their status.
func discardBulkNote(forget bool) string {
	if forget {
		return "The kept messages are deleted and their keys forgotten (those parked or released): their next deliveries run the handler. This cannot be undone."
	}
	return "The kept messages are deleted; their parked keys stay recorded, as discarded, so a late redelivery is still not run (a released key's next delivery runs, as before). This cannot be undone."
}

// changedText says on a confirmation page that the count confirmed no
// longer holds: still of the expected match within its bounds, now match
// now.
func changedText(still, expected, now int64, one, many string) string {
	was := fmt.Sprintf("%d of the %s you confirmed still match", still, plural(expected, one, many))
	if still > expected {
		was = fmt.Sprintf("%s match the count you confirmed, not the %d you confirmed", plural(still, one, many), expected)
	}
	return fmt.Sprintf("Nothing was done: %s; %s now. Confirm again with the new count.", was, plural(now, one+" matches", many+" match"))
}

// stoppedText is the note of the confirmation a bulk action that stopped
// part-way answers with: what it did, why it stopped, what confirming now
// does.
func stoppedText(past string, done int64, why, one, many string) string {
	return fmt.Sprintf("%s %s, then stopped: %s. What was done no longer matches; the rest is counted below: confirm to go on.",
		past, plural(done, one, many), why)
}

// actionFailed shows the result page of an action the store refused. A
// target that changed since the confirmation says so, and leads back to
// it.
func (h *handler) actionFailed(w http.ResponseWriter, r *http.Request, heading string, err error, back string) error {
	e := h.classify(r, err)
	if e.code == codeChanged {
		return h.changedPage(w, r, heading+": changed since you confirmed", "Nothing was done: "+e.message+".", back)
	}
	h.render(w, r, e.status, "result", heading, resultData{Heading: heading, Text: heading + ": " + e.message, BackURL: back, Back: "Back"})
	return nil
}

// changedPage answers an action whose target is not what the operator was
// shown (409): what it is now, nothing done, and a link to look again.
func (h *handler) changedPage(w http.ResponseWriter, r *http.Request, heading, text, back string) error {
	h.logRefusal(r, http.StatusConflict, codeChanged, text)
	h.render(w, r, http.StatusConflict, "result", heading, resultData{Heading: heading, Text: text,
		Details: []string{"Nothing was done. Look at it again, and confirm what you see then."}, BackURL: back, Back: "Look at it again"})
	return nil
}

func (h *handler) pageParkedBulk(verb string) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error {
		if err := r.ParseForm(); err != nil {
			return badFilter("the form: %v", err)
		}
		ok, expect, err := confirmed(r)
		if err != nil {
			return err
		}
		now := time.Now()
		if ok {
			now = time.Time{} // the confirmation's times are the count's
		}
		pq, err := h.parkedFilterFrom(r.PostForm, now)
		if err != nil {
			return err
		}
		topic, forget, all := strings.TrimSpace(r.PostFormValue("topic")), r.PostFormValue("forget") == "1", pq.empty()
		if err := checkText("topic", topic); err != nil {
			return err
		}
		back := h.prefix + "/parked?" + pq.values().Encode()
		b := bulkParked{query: pq, topic: topic, forget: forget, all: all, expect: expect}
		confirm := func(status int, n int64, asOf time.Time, changed string) {
			fields := append(fieldsOf(pq.values()), field{"expect", strconv.FormatInt(n, 10)}, field{"as_of", fmtBound(asOf)}, field{"confirmed", "1"})
			d := confirmData{Action: h.prefix + "/parked/" + verb, Fields: fields, CancelURL: back, Matching: "Matching: " + pq.describe() + ".",
				Changed: changed, Zero: n == 0}
			if verb == "replay" {
				if topic != "" {
					d.Fields = append(d.Fields, field{"topic", topic})
				}
				d.Heading, d.Count, d.Button = "Replay parked messages", "This replays "+plural(n, "message", "messages")+".", "Replay "+plural(n, "message", "messages")
				d.Note = "Each key is released and its message published again with its UUID; messages that cannot be replayed are skipped and counted."
			} else {
				if forget {
					d.Fields = append(d.Fields, field{"forget", "1"})
				}
				d.Heading, d.Count, d.Button, d.Danger = "Discard parked messages", "This discards "+plural(n, "message", "messages")+".", "Discard "+plural(n, "message", "messages"), true
				d.Note = discardBulkNote(forget)
			}
			h.render(w, r, status, "confirm", d.Heading, d)
		}
		if !ok {
			ctx, cancel := readCtx(r)
			defer cancel()
			c, err := h.countParked(ctx, pq)
			if err != nil {
				return err
			}
			confirm(http.StatusOK, c.Count, c.AsOf, "")
			return nil
		}
		if b.asOf, err = parseAsOf(r.PostFormValue("as_of")); err != nil {
			return err
		}
		did, err := h.runParked(r, verb, b)
		matched, done, skipped := did.Matched, did.Done, did.Skipped
		var ae *apiError
		if errors.As(err, &ae) && ae.code == codeCountChanged {
			confirm(http.StatusConflict, *ae.count, *ae.asOf, changedText(matched, expect, *ae.count, "message", "messages"))
			return nil
		}
		res := resultData{BackURL: back, Back: "Back to the parked messages"}
		past := map[string]string{"replay": "Replayed", "discard": "Discarded"}[verb]
		var se *ops.StoppedError
		if errors.As(err, &se) {
			// Where to resume: the rest, counted again, to confirm.
			e := h.stoppedAnswer(r, se, strings.ToLower(past), "message", "messages", h.parkedResume(pq))
			if e.resume != nil {
				confirm(e.status, e.resume.Count, e.resume.AsOf, stoppedText(past, done, h.classify(r, se.Err).message, "message", "messages"))
				return nil
			}
			err = e
		}
		if err != nil {
			e := h.classify(r, err)
			res.Heading = "Not done"
			res.Text = fmt.Sprintf("%s %s, then stopped: %s", past, plural(done, "message", "messages"), e.message)
			h.render(w, r, e.status, "result", res.Heading, res)
			return nil
		}
		res.Heading, res.OK = past, true
		res.Text = fmt.Sprintf("%s %s.", past, plural(done, "message", "messages"))
		if skipped > 0 {
			res.Details = append(res.Details, fmt.Sprintf("%s skipped: not replayable (the message page says why), or replayed or discarded by someone else meanwhile.", plural(skipped, "message", "messages")))
		}
		h.render(w, r, http.StatusOK, "result", res.Heading, res)
		return nil
	}
}

func outboxForm(v url.Values) outboxFormValues {
	return outboxFormValues{State: v.Get("state"), Topic: v.Get("topic"), UUID: v.Get("uuid"), Reason: v.Get("reason"),
		Since: v.Get("since"), Before: v.Get("before"), OrderingKey: v.Get("ordering_key"), Meta: v["meta"]}
}

func (h *handler) pageOutbox(w http.ResponseWriter, r *http.Request) error {
	if err := h.needDB(); err != nil {
		return err
	}
	q := r.URL.Query()
	d := outboxListData{Form: outboxForm(q)}
	if snap, _ := h.stats.get(r.Context()); snap != nil {
		d.Figures, d.AsOf = snap.Outbox, &snap.AsOf
	}
	oq, err := outboxFilterFrom(q, time.Now())
	if err == nil {
		err = checkParams(q, outboxFields, []string{"limit", "after"})
	}
	limit := defaultLimit
	if err == nil {
		limit, err = parseLimit(q.Get("limit"))
	}
	var after int64
	if s := q.Get("after"); err == nil && s != "" {
		if after, err = strconv.ParseInt(s, 10, 64); err != nil || after < 0 {
			err = badFilter("after is %q: a row id", s)
		}
	}
	oq.Filter = h.boundRows(oq.Filter)
	var release func()
	if err == nil {
		release, err = h.scanSlot(w, oq.Filter.Scans())
	}
	if err != nil {
		e := h.classify(r, err)
		d.Error = e.message
		h.render(w, r, e.status, "outbox", "Outbox", d)
		return nil
	}
	defer release()
	ctx, cancel := readCtx(r)
	defer cancel()
	page, err := h.rows.Find(ctx, oq.Filter, rowsPage(after, limit))
	if err == nil {
		d.Count, err = h.rows.Count(ctx, oq.Filter)
		if errors.Is(err, outbox.ErrTooBroad) && len(page.Rows) > 0 {
			// The page is shown; the count (and a bulk action) is not.
			d.Count, d.CountOver, err = 0, h.cfg.MaxCount, nil
		}
	}
	if err != nil {
		e := h.classify(r, err)
		d.Error = e.message
		h.render(w, r, e.status, "outbox", "Outbox", d)
		return nil
	}
	d.Matching = oq.describe()
	for _, row := range page.Rows {
		d.Rows = append(d.Rows, rowView{ID: row.ID, Topic: row.Topic, UUID: row.UUID, LastError: row.LastError, OrderingKey: row.OrderingKey,
			Waiting: row.Waiting, Failures: row.Failures, PermanentFailures: row.PermanentFailures, State: ops.RowState(row),
			URL: h.prefix + "/outbox/rows/" + strconv.FormatInt(row.ID, 10), KeyURL: h.keyURL(row.OrderingKey)})
	}
	if page.Next != "" {
		v := oq.values()
		v.Set("after", page.Next)
		if limit != defaultLimit {
			v.Set("limit", strconv.Itoa(limit))
		}
		d.NextURL = h.prefix + "/outbox?" + v.Encode()
	}
	d.Bulk = fieldsOf(oq.values())
	d.Discard = oq.Filter.State == "" || oq.Filter.State == outbox.StateQuarantined
	h.render(w, r, http.StatusOK, "outbox", "Outbox", d)
	return nil
}

// keyURL is the outbox page listing the failed rows of an ordering key
// (those that block it); "" for no key.
func (h *handler) keyURL(key string) string {
	if key == "" {
		return ""
	}
	return h.prefix + "/outbox?" + url.Values{"state": {string(outbox.StateAll)}, "ordering_key": {key}}.Encode()
}

func (h *handler) pageRow(w http.ResponseWriter, r *http.Request) error {
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
	base := h.prefix + "/outbox/rows/" + strconv.FormatInt(id, 10)
	md := row.Metadata
	if md == nil {
		md = map[string]string{"(stored metadata, not an object of strings)": string(row.RawMetadata)}
	}
	d := rowData{Row: row, KeyURL: h.keyURL(row.OrderingKey), State: ops.RowState(row), Payload: payloadViewOf(row.Payload, true, row.PayloadSize, fmt.Sprintf("exactlyonce outbox show --full-payload %d", id)), Metadata: metaEntries(md),
		RequeueURL: base + "/requeue", DiscardURL: base + "/discard", Quarantined: row.Quarantined()}
	h.render(w, r, http.StatusOK, "row", fmt.Sprintf("Outbox row %d", id), d)
	return nil
}

func (h *handler) pageRowOne(verb string) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error {
		if err := h.needDB(); err != nil {
			return err
		}
		if err := r.ParseForm(); err != nil {
			return badFilter("the form: %v", err)
		}
		id, err := rowID(r)
		if err != nil {
			return err
		}
		version := r.PostFormValue("version")
		if err := checkText("version", version); err != nil {
			return err
		}
		ok, expect, err := confirmed(r)
		if err != nil {
			return err
		}
		back := h.prefix + "/outbox/rows/" + strconv.FormatInt(id, 10)
		if !ok {
			ctx, cancel := readCtx(r)
			defer cancel()
			row, err := h.rows.GetPrefix(ctx, id, 0)
			if err != nil {
				return err
			}
			if version != "" && version != row.Version {
				return h.changedPage(w, r, "Changed since you opened it",
					fmt.Sprintf("Outbox row %d is now %s (%d failures, %d its own): not what the page showed.", id, ops.RowState(row), row.Failures, row.PermanentFailures), back)
			}
			d := confirmData{Action: back + "/" + verb, CancelURL: back, Fields: []field{{"expect", "1"}, {"confirmed", "1"}, {"version", row.Version}},
				Matching: fmt.Sprintf("Outbox row %d (topic %q, message %s).", row.ID, row.Topic, row.UUID)}
			if verb == "requeue" {
				d.Heading, d.Count, d.Button = "Requeue an outbox row", "This requeues 1 row.", "Requeue 1 row"
				d.Note = "Its failure record is cleared: the relay publishes it again now, with its UUID."
			} else {
				d.Heading, d.Count, d.Button, d.Danger = "Discard an outbox row", "This discards 1 row.", "Discard 1 row", true
				d.Note = "The row is deleted: its message is never published. This cannot be undone."
			}
			if !row.Quarantined() {
				d.Zero = true
				d.Count = "This " + verb + "s 0 rows."
				d.Note = fmt.Sprintf("Row %d is %s, not quarantined: the relay still owns it, so it cannot be %sd from here.", id, ops.RowState(row), verb)
			}
			h.render(w, r, http.StatusOK, "confirm", d.Heading, d)
			return nil
		}
		if expect != 1 {
			return badFilter("expect is %d: an action on one row confirms 1", expect)
		}
		if version == "" {
			return badFilter("the confirmation carries the version of the row it showed, and this one has none: open the row again")
		}
		ctx, cancel := actionCtx(r)
		defer cancel()
		err = h.rowOne(ctx, r, verb, id, outbox.Expect{Version: version})
		past := map[string]string{"requeue": "Requeued", "discard": "Discarded"}[verb]
		if err != nil {
			return h.actionFailed(w, r, "Not "+strings.ToLower(past), err, back)
		}
		res := resultData{Heading: past, OK: true, Text: past + " 1 row.", BackURL: h.prefix + "/outbox", Back: "Back to the outbox"}
		h.render(w, r, http.StatusOK, "result", res.Heading, res)
		return nil
	}
}

func (h *handler) pageRowsBulk(verb string) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error {
		if err := h.needDB(); err != nil {
			return err
		}
		if err := r.ParseForm(); err != nil {
			return badFilter("the form: %v", err)
		}
		ok, expect, err := confirmed(r)
		if err != nil {
			return err
		}
		now := time.Now()
		if ok {
			now = time.Time{} // the confirmation's times are the count's
		}
		oq, err := outboxFilterFrom(r.PostForm, now)
		if err != nil {
			return err
		}
		oq.Filter = h.boundRows(oq.Filter)
		back := h.prefix + "/outbox?" + oq.values().Encode()
		b := bulkRows{query: oq, all: oq.empty(), expect: expect}
		confirm := func(status int, c ops.Confirmation, changed string) {
			n := c.Count
			fields := append(fieldsOf(oq.values()), field{"expect", strconv.FormatInt(n, 10)}, field{"as_of", fmtBound(c.AsOf)},
				field{"max_id", strconv.FormatInt(c.MaxID, 10)}, field{"confirmed", "1"})
			d := confirmData{Action: h.prefix + "/outbox/" + verb, Fields: fields, CancelURL: back, Matching: "Matching: " + oq.describe() + ".",
				Changed: changed, Zero: n == 0}
			if verb == "requeue" {
				d.Heading, d.Count, d.Button = "Requeue outbox rows", "This requeues "+plural(n, "row", "rows")+".", "Requeue "+plural(n, "row", "rows")
				d.Note = "Their failure records are cleared: the relay publishes them again now, with their UUIDs."
			} else {
				d.Heading, d.Count, d.Button, d.Danger = "Discard outbox rows", "This discards "+plural(n, "row", "rows")+".", "Discard "+plural(n, "row", "rows"), true
				d.Note = "The rows are deleted: their messages are never published. This cannot be undone."
			}
			h.render(w, r, status, "confirm", d.Heading, d)
		}
		if !ok {
			if verb == "discard" && oq.Filter.State != "" && oq.Filter.State != outbox.StateQuarantined {
				return badFilter("only quarantined rows can be discarded (a failing row is still the relay's)")
			}
			ctx, cancel := readCtx(r)
			defer cancel()
			c, err := h.rows.Confirm(ctx, oq.Filter)
			if err != nil {
				return err
			}
			confirm(http.StatusOK, c, "")
			return nil
		}
		if b.asOf, err = parseAsOf(r.PostFormValue("as_of")); err != nil {
			return err
		}
		if b.maxID, err = strconv.ParseInt(r.PostFormValue("max_id"), 10, 64); err != nil {
			return badFilter("max_id is %q: the max_id of the count you confirmed", r.PostFormValue("max_id"))
		}
		if err := (ops.Confirmation{Count: expect, AsOf: b.asOf, MaxID: b.maxID}).Check(true); err != nil {
			return badFilter("%s", err)
		}
		did, err := h.runRows(r, verb, b)
		matched, done := did.Matched, did.Done
		var ae *apiError
		if errors.As(err, &ae) && ae.code == codeCountChanged {
			confirm(http.StatusConflict, ops.Confirmation{Count: *ae.count, AsOf: *ae.asOf, MaxID: *ae.maxID}, changedText(matched, expect, *ae.count, "row", "rows"))
			return nil
		}
		past := map[string]string{"requeue": "Requeued", "discard": "Discarded"}[verb]
		res := resultData{BackURL: back, Back: "Back to the outbox"}
		var se *ops.StoppedError
		if errors.As(err, &se) {
			e := h.stoppedAnswer(r, se, strings.ToLower(past), "row", "rows", h.rowsResume(oq))
			if e.resume != nil {
				confirm(e.status, ops.Confirmation{Count: e.resume.Count, AsOf: e.resume.AsOf, MaxID: *e.resume.MaxID},
					stoppedText(past, done, h.classify(r, se.Err).message, "row", "rows"))
				return nil
			}
			err = e
		}
		if err != nil {
			e := h.classify(r, err)
			res.Heading = "Not done"
			res.Text = fmt.Sprintf("%s %s, then stopped: %s", past, plural(done, "row", "rows"), e.message)
			h.render(w, r, e.status, "result", res.Heading, res)
			return nil
		}
		res.Heading, res.OK, res.Text = past, true, fmt.Sprintf("%s %s.", past, plural(done, "row", "rows"))
		if done < matched {
			res.Details = append(res.Details, fmt.Sprintf("%s matched; the others were held by a relay or changed by someone else meanwhile.", plural(matched, "row", "rows")))
		}
		h.render(w, r, http.StatusOK, "result", res.Heading, res)
		return nil
	}
}

func (h *handler) pageInbox(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	d := inboxData{Store: q.Get("store"), Consumer: q.Get("consumer"), Key: q.Get("key"), Tenant: q.Get("tenant")}
	if d.Consumer == "" && d.Key == "" {
		h.render(w, r, http.StatusOK, "inbox", "Inbox lookup", d)
		return nil
	}
	d.Searched = true
	fail := func(err error) error {
		e := h.classify(r, err)
		d.Error = e.message
		h.render(w, r, e.status, "inbox", "Inbox lookup", d)
		return nil
	}
	store, err := h.storeOf(d.Store)
	if err != nil {
		return fail(err)
	}
	if d.Consumer == "" || d.Key == "" {
		return fail(badFilter("give both the consumer and the key"))
	}
	for _, c := range []struct{ name, v string }{{"consumer", d.Consumer}, {"key", d.Key}} {
		if err := checkText(c.name, c.v); err != nil {
			return fail(err)
		}
	}
	key, err := tenantKey(d.Tenant, d.Key)
	if err != nil {
		return fail(err)
	}
	ctx, cancel := readCtx(r)
	defer cancel()
	s := h.parked(store)
	rec, err := s.Get(ctx, d.Consumer, key)
	if err != nil {
		return fail(h.notFoundOrUnknown(ctx, store, d.Consumer, err))
	}
	_, perr := s.GetParkedPrefix(ctx, d.Consumer, key, 0)
	if perr != nil && !errors.Is(perr, inbox.ErrNotParked) {
		return fail(perr)
	}
	doc := recordDoc(store, rec, perr == nil)
	d.Record, d.Store = &doc, store
	if perr == nil {
		d.ParkedURL = h.messageURL(store, d.Consumer, key)
	}
	h.render(w, r, http.StatusOK, "inbox", "Inbox lookup", d)
	return nil
}

func (h *handler) pageForget(w http.ResponseWriter, r *http.Request) error {
	if err := r.ParseForm(); err != nil {
		return badFilter("the form: %v", err)
	}
	store, err := h.storeOf(r.PostFormValue("store"))
	if err != nil {
		return err
	}
	consumer, key := r.PostFormValue("consumer"), r.PostFormValue("key")
	for _, c := range []struct{ name, v string }{{"consumer", consumer}, {"key", key}} {
		if c.v == "" {
			return badFilter("%s is required", c.name)
		}
		if err := checkText(c.name, c.v); err != nil {
			return err
		}
	}
	shown, err := expectOf(r.PostFormValue("version"), "", "")
	if err != nil {
		return err
	}
	ok, expect, err := confirmed(r)
	if err != nil {
		return err
	}
	v := url.Values{"consumer": {consumer}, "key": {key}, "store": {store}}
	back := h.prefix + "/inbox?" + v.Encode()
	if !ok {
		ctx, cancel := readCtx(r)
		defer cancel()
		rec, err := h.parked(store).Get(ctx, consumer, key)
		if err != nil {
			return h.notFoundOrUnknown(ctx, store, consumer, err)
		}
		if shown.Version != "" && shown.Version != rec.Version {
			return h.changedPage(w, r, "Changed since you looked it up",
				fmt.Sprintf("The record of consumer %q, key %q is now %s (attempt %d): not what the page showed.", consumer, key, rec.Status, rec.Attempts), back)
		}
		d := confirmData{Heading: "Forget a key", Count: "This forgets 1 key.", Button: "Forget 1 key", Danger: true,
			Action: h.prefix + "/inbox/forget", CancelURL: back,
			Fields:   []field{{"store", store}, {"consumer", consumer}, {"key", key}, {"expect", "1"}, {"confirmed", "1"}, {"version", rec.Version}},
			Matching: fmt.Sprintf("Consumer %q, key %q (status %s).", consumer, key, rec.Status),
			Note:     "Its record (and its parked message, if any) is deleted: the key's next delivery runs the handler again. It undoes no effect."}
		h.render(w, r, http.StatusOK, "confirm", d.Heading, d)
		return nil
	}
	if expect != 1 {
		return badFilter("expect is %d: forgetting one key confirms 1", expect)
	}
	if shown.Version == "" {
		return badFilter("the confirmation carries the version of the record it showed, and this one has none: look the key up again")
	}
	ctx, cancel := actionCtx(r)
	defer cancel()
	if err := h.forgetOne(ctx, r, store, consumer, key, shown); err != nil {
		return h.actionFailed(w, r, "Not forgotten", err, back)
	}
	res := resultData{Heading: "Forgotten", OK: true, Text: "Forgot 1 key: its next delivery runs the handler again.", BackURL: h.prefix + "/inbox", Back: "Back to the inbox lookup"}
	h.render(w, r, http.StatusOK, "result", res.Heading, res)
	return nil
}

// --- static assets

var staticTypes = map[string]string{"console.css": "text/css; charset=utf-8", "console.js": "text/javascript; charset=utf-8"}

func serveStatic(w http.ResponseWriter, r *http.Request, name string) {
	ct, ok := staticTypes[name]
	if !ok {
		http.NotFound(w, r)
		return
	}
	b, err := assets.ReadFile("static/" + name)
	if err != nil {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", ct)
	w.Header().Set("Cache-Control", "no-cache")
	http.ServeContent(w, r, name, time.Time{}, bytes.NewReader(b))
}
