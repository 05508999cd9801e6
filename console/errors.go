package console

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The API's error codes: stable, for scripts to act on.
const (
	codeUnauthenticated      = "unauthenticated"        // 401: no or wrong credentials
	codeForbidden            = "forbidden"              // 403: (reserved for authorisers that refuse a user)
	codeReadOnly             = "read_only"              // 403: the console is read-only
	codeCrossOrigin          = "cross_origin"           // 403: an action from another site
	codeUnknownConsumer      = "unknown_consumer"       // 404: no record and no parked message of the consumer
	codeNotFound             = "not_found"              // 404: no such key, parked message, row or endpoint
	codeMethodNotAllowed     = "method_not_allowed"     // 405
	codeMisdirected          = "misdirected"            // 421: a name (Host) the console does not answer to
	codeBadFilter            = "bad_filter"             // 400: a malformed parameter or body
	codePageTooLarge         = "page_too_large"         // 400: limit over 1000
	codeTooLarge             = "body_too_large"         // 413: a body over 1 MiB
	codeUnsupportedMediaType = "unsupported_media_type" // 415: an action's body that is not said to be JSON
	codeCountChanged         = "count_changed"          // 409: a bulk action's expect is not the matching count
	codeNotReplayable        = "not_replayable"         // 409: a parked message that cannot be replayed as it is
	codeNotQuarantined       = "not_quarantined"        // 409: an outbox row the relay still owns
	codeInProgress           = "in_progress"            // 409: a Redis replay of the message is in flight
	codeChanged              = "changed"                // 409: the key, message or row is not what the action was shown
	codeTooManyFailures      = "too_many_failures"      // 429: the client's failed sign-ins are over Config.SignInFailures
	codeTooBroad             = "too_broad"              // 422: a search or count over its bound (Config.MaxScan, MaxCount)
	codeBusy                 = "busy"                   // 429: Config.MaxConcurrentScans searches by text under way
	codeUnavailable          = "unavailable"            // 503: database or Redis unreachable, tables not migrated, store not configured
	codeInternal             = "internal"               // 500: anything else (logged)
)

// apiError is an error the API answers with.
type apiError struct {
	status  int
	code    string
	message string
	// consumers are the known consumers (unknown_consumer).
	consumers []string
	// count is the matching count now (count_changed), asOf and maxID
	// its bounds.
	count *int64
	asOf  *time.Time
	maxID *int64
	// done and resume are a bulk action's that stopped part-way: how many
	// it did, and the count of the rest to confirm to go on.
	done   *int64
	resume *resumeJSON
}

// resumeJSON is where a bulk action that stopped part-way resumes: what
// it did no longer matches its filter, so the rest is the filter counted
// again; confirm this count (expect, as_of, and max_id for outbox rows)
// with the same filter to go on.
type resumeJSON struct {
	Count int64     `json:"count"`
	AsOf  time.Time `json:"as_of"`
	MaxID *int64    `json:"max_id,omitempty"`
}

func (e *apiError) Error() string { return e.message }

func badFilter(format string, args ...any) *apiError {
	return &apiError{status: http.StatusBadRequest, code: codeBadFilter, message: fmt.Sprintf(format, args...)}
}

func notFound(format string, args ...any) *apiError {
	return &apiError{status: http.StatusNotFound, code: codeNotFound, message: fmt.Sprintf(format, args...)}
}

func unavailable(format string, args ...any) *apiError {
	return &apiError{status: http.StatusServiceUnavailable, code: codeUnavailable, message: fmt.Sprintf(format, args...)}
}

type errorBody struct {
	Error errorJSON `json:"error"`
}

type errorJSON struct {
	Code      string   `json:"code"`
	Message   string   `json:"message"`
	Consumers []string `json:"consumers,omitempty"`
	Count     *int64   `json:"count,omitempty"`
	// AsOf and MaxID are the bounds of Count (count_changed): what a
	// confirmation of it carries.
	AsOf  *time.Time `json:"as_of,omitempty"`
	MaxID *int64     `json:"max_id,omitempty"`
	// Done and Resume: a bulk action that stopped part-way (an error, the
	// action timeout) did Done, and resumes with the count in Resume.
	Done   *int64      `json:"done,omitempty"`
	Resume *resumeJSON `json:"resume,omitempty"`
}

func writeError(w http.ResponseWriter, e *apiError) {
	writeJSON(w, e.status, errorBody{errorJSON{Code: e.code, Message: e.message, Consumers: e.consumers, Count: e.count, AsOf: e.asOf, MaxID: e.maxID,
		Done: e.done, Resume: e.resume}})
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json; charset=utf-8")
	w.WriteHeader(status)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v)
}

// classify turns an error of a store into the API's: the request's fault
// (4xx, with the store's reason), the service's state (503), or an
// internal error (500, logged, not detailed).
func (h *handler) classify(r *http.Request, err error) *apiError {
	ae, unreachable := classOf(err)
	switch {
	case unreachable:
		h.log.Error("exactlyonce console: a store is unavailable", "error", err, "path", r.URL.Path)
		return ae
	case ae != nil:
		return ae
	case errors.Is(err, context.Canceled) && r.Context().Err() != nil:
		return &apiError{status: 499, code: codeUnavailable, message: "the request was cancelled"}
	}
	h.log.Error("exactlyonce console: internal error", "error", err, "method", r.Method, "path", r.URL.Path, "user", userOf(r))
	return &apiError{status: http.StatusInternalServerError, code: codeInternal, message: internalMessage}
}

// internalMessage is what an error that is neither the request's fault
// nor the service's known state is shown as: its details are logged,
// never shown.
const internalMessage = "internal error; the server's log has the details"

// classOf is the API's error for err when err is the request's fault or
// the service's known state, else nil (an internal error). unreachable
// says a store cannot be reached or did not answer in time: the answer
// says so without the driver's error, which names the database role,
// the database and its address; log err itself.
func classOf(err error) (ae *apiError, unreachable bool) {
	var mbe *http.MaxBytesError
	var ce *pgconn.ConnectError
	var ne net.Error
	switch {
	case errors.As(err, &ae):
		return ae, false
	case errors.As(err, &mbe):
		return &apiError{status: http.StatusRequestEntityTooLarge, code: codeTooLarge, message: fmt.Sprintf("the request's body is over %d bytes", mbe.Limit)}, false
	case errors.Is(err, inbox.ErrInvalidFilter):
		return badFilter("%s", err), false
	case errors.Is(err, inbox.ErrNotParked), errors.Is(err, inbox.ErrNotFound), errors.Is(err, outbox.ErrRowNotFound):
		return notFound("%s", err), false
	case errors.Is(err, inbox.ErrChanged):
		return &apiError{status: http.StatusConflict, code: codeChanged, message: err.Error()}, false
	case errors.Is(err, inbox.ErrReplayInProgress):
		return &apiError{status: http.StatusConflict, code: codeInProgress, message: err.Error()}, false
	case errors.Is(err, inbox.ErrNotReplayable):
		return &apiError{status: http.StatusConflict, code: codeNotReplayable, message: err.Error()}, false
	case errors.Is(err, inbox.ErrTooBroad), errors.Is(err, outbox.ErrTooBroad):
		return &apiError{status: http.StatusUnprocessableEntity, code: codeTooBroad,
			message: err.Error() + ": narrow the filter (a consumer, a time range, a reason or a metadata field)"}, false
	case errors.Is(err, outbox.ErrNotQuarantined):
		return &apiError{status: http.StatusConflict, code: codeNotQuarantined, message: err.Error()}, false
	case errors.Is(err, sqlschema.ErrNotMigrated):
		return unavailable("%s", err), false
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ce), errors.As(err, &ne):
		return unavailable("the database or Redis did not answer in time, or cannot be reached; see the server's log"), true
	}
	return nil, false
}

// shownError is what a user is shown of err, an error of work done for no
// request in particular (the overview's figures, computed in the
// background): what the API answers a request with for it, never the
// details that classify logs (the caller logs them, once).
func shownError(err error) string {
	if ae, _ := classOf(err); ae != nil {
		return ae.message
	}
	return internalMessage
}

// logRefusal logs a refused request at warn: the user (when the request
// was authenticated), the address, the method, the path, the code and why.
func (h *handler) logRefusal(r *http.Request, status int, code, reason string) {
	attrs := []any{"remote_addr", r.RemoteAddr, "method", r.Method, "path", r.URL.Path, "status", status, "code", code, "reason", reason}
	if u := userOf(r); u != "" {
		attrs = append([]any{"user", u}, attrs...)
	}
	h.log.Warn("exactlyonce console: refused", attrs...)
}

// refuse answers a refused request, and logs it: JSON for the API, a page
// otherwise.
func (h *handler) refuse(w http.ResponseWriter, r *http.Request, api bool, status int, code, message string) {
	h.logRefusal(r, status, code, message)
	if api {
		writeError(w, &apiError{status: status, code: code, message: message})
		return
	}
	h.render(w, r, status, "notice", "Refused", noticeData{Heading: "Refused", Text: message})
}
