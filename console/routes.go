package console

import (
	"net/http"
	"strings"
)

// routes registers the API's endpoints and the pages.
func (h *handler) routes() {
	api := http.NewServeMux()
	a := func(pattern string, fn func(http.ResponseWriter, *http.Request) error) {
		method, path, _ := strings.Cut(pattern, " ")
		api.HandleFunc(method+" "+h.prefix+"/api/v1"+path, h.apiFunc(fn))
	}
	a("GET /overview", h.apiOverview)
	a("GET /consumers", h.apiConsumers)
	a("GET /consumers/{consumer}", h.apiConsumer)
	a("GET /consumers/{consumer}/keys/{key}", h.apiKey)
	a("DELETE /consumers/{consumer}/keys/{key}", h.apiForget)
	a("GET /parked", h.apiParkedList)
	a("GET /parked/count", h.apiParkedCount)
	a("POST /parked/replay", h.apiParkedBulk("replay"))
	a("POST /parked/discard", h.apiParkedBulk("discard"))
	a("GET /parked/{consumer}/{key}", h.apiParkedGet)
	a("POST /parked/{consumer}/{key}/replay", h.apiParkedReplay)
	a("POST /parked/{consumer}/{key}/discard", h.apiParkedDiscard)
	a("GET /outbox", h.apiOutbox)
	a("GET /outbox/rows", h.apiRows)
	a("GET /outbox/rows/count", h.apiRowsCount)
	a("POST /outbox/rows/requeue", h.apiRowsBulk("requeue"))
	a("POST /outbox/rows/discard", h.apiRowsBulk("discard"))
	a("GET /outbox/rows/{id}", h.apiRow)
	a("POST /outbox/rows/{id}/requeue", h.apiRowAction("requeue"))
	a("POST /outbox/rows/{id}/discard", h.apiRowAction("discard"))
	a("GET /relays", h.apiRelays)
	api.HandleFunc(h.apiRoot, h.apiFallback)
	h.apiMux = api

	m := http.NewServeMux()
	p := func(pattern string, fn func(http.ResponseWriter, *http.Request) error) {
		method, path, _ := strings.Cut(pattern, " ")
		m.HandleFunc(method+" "+h.prefix+path, h.pageFunc(fn))
	}
	p("GET /{$}", h.pageOverview)
	p("GET /parked", h.pageParked)
	p("POST /parked/replay", h.pageParkedBulk("replay"))
	p("POST /parked/discard", h.pageParkedBulk("discard"))
	p("GET /parked/{consumer}/{key}", h.pageMessage)
	p("POST /parked/{consumer}/{key}/replay", h.pageParkedOne("replay"))
	p("POST /parked/{consumer}/{key}/discard", h.pageParkedOne("discard"))
	p("GET /outbox", h.pageOutbox)
	p("POST /outbox/requeue", h.pageRowsBulk("requeue"))
	p("POST /outbox/discard", h.pageRowsBulk("discard"))
	p("GET /outbox/rows/{id}", h.pageRow)
	p("POST /outbox/rows/{id}/requeue", h.pageRowOne("requeue"))
	p("POST /outbox/rows/{id}/discard", h.pageRowOne("discard"))
	p("GET /inbox", h.pageInbox)
	p("POST /inbox/forget", h.pageForget)
	m.HandleFunc("POST "+h.prefix+"/logout", h.logout)
	m.Handle(h.apiRoot, api)
	m.HandleFunc(h.prefix+"/", func(w http.ResponseWriter, r *http.Request) {
		h.render(w, r, http.StatusNotFound, "notice", "Not found", noticeData{Heading: "Not found", Text: "There is no page at this address."})
	})
	h.mux = m
}

// apiFunc answers fn's error as the API's JSON error.
func (h *handler) apiFunc(fn func(http.ResponseWriter, *http.Request) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := fn(w, r); err != nil {
			writeError(w, h.classify(r, err))
		}
	}
}

// apiFallback answers a request no endpoint takes: 405 when the path is
// an endpoint's with another method, else 404.
func (h *handler) apiFallback(w http.ResponseWriter, r *http.Request) {
	var allowed []string
	for _, m := range []string{http.MethodGet, http.MethodPost, http.MethodDelete} {
		if m == r.Method {
			continue
		}
		r2 := r.Clone(r.Context())
		r2.Method = m
		if _, pattern := h.apiMux.Handler(r2); pattern != "" && pattern != h.apiRoot {
			allowed = append(allowed, m)
		}
	}
	if len(allowed) > 0 {
		w.Header().Set("Allow", strings.Join(allowed, ", "))
		writeError(w, &apiError{status: http.StatusMethodNotAllowed, code: codeMethodNotAllowed,
			message: r.Method + " is not allowed here: " + strings.Join(allowed, ", ")})
		return
	}
	writeError(w, notFound("no such endpoint: %s %s (the API is under %sv1/)", r.Method, r.URL.Path, h.apiRoot))
}

// pageFunc answers fn's error as a page.
func (h *handler) pageFunc(fn func(http.ResponseWriter, *http.Request) error) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := fn(w, r); err != nil {
			e := h.classify(r, err)
			h.render(w, r, e.status, "notice", "Error", noticeData{Heading: errorHeading(e), Text: e.message, Consumers: e.consumers})
		}
	}
}

func errorHeading(e *apiError) string {
	switch e.code {
	case codeUnknownConsumer:
		return "Unknown consumer"
	case codeNotFound:
		return "Not found"
	case codeBadFilter, codePageTooLarge:
		return "Bad request"
	case codeUnavailable:
		return "Unavailable"
	}
	return "Error"
}
