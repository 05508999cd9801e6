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
	"github.com/exactlyonce/watermill-exactlyonce/redisstore"
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
}

func writeError(w http.ResponseWriter, e *apiError) {
	writeJSON(w, e.status, errorBody{errorJSON{Code: e.code, Message: e.message, Consumers: e.consumers, Count: e.count, AsOf: e.asOf, MaxID: e.maxID}})
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
	var ae *apiError
	var mbe *http.MaxBytesError
	var ce *pgconn.ConnectError
	var ne net.Error
	switch {
	case errors.As(err, &ae):
		return ae
	case errors.As(err, &mbe):
		return &apiError{status: http.StatusRequestEntityTooLarge, code: codeTooLarge, message: fmt.Sprintf("the request's body is over %d bytes", mbe.Limit)}
	case errors.Is(err, inbox.ErrInvalidFilter):
		return badFilter("%s", err)
	case errors.Is(err, inbox.ErrNotParked), errors.Is(err, inbox.ErrNotFound), errors.Is(err, outbox.ErrRowNotFound):
		return notFound("%s", err)
	case errors.Is(err, redisstore.ErrReplayInProgress):
		return &apiError{status: http.StatusConflict, code: codeInProgress, message: err.Error()}
	case errors.Is(err, inbox.ErrNotReplayable):
		return &apiError{status: http.StatusConflict, code: codeNotReplayable, message: err.Error()}
	case errors.Is(err, inbox.ErrTooBroad), errors.Is(err, outbox.ErrTooBroad):
		return &apiError{status: http.StatusUnprocessableEntity, code: codeTooBroad, message: err.Error()}
	case errors.Is(err, outbox.ErrNotQuarantined):
		return &apiError{status: http.StatusConflict, code: codeNotQuarantined, message: err.Error()}
	case errors.Is(err, sqlschema.ErrNotMigrated):
		return unavailable("%s", err)
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ce), errors.As(err, &ne):
		h.log.Error("exactlyonce console: a store is unavailable", "error", err, "path", r.URL.Path)
		return unavailable("the database or Redis did not answer in time, or cannot be reached; see the server's log")
	case errors.Is(err, context.Canceled) && r.Context().Err() != nil:
		return &apiError{status: 499, code: codeUnavailable, message: "the request was cancelled"}
	}
	h.log.Error("exactlyonce console: internal error", "error", err, "method", r.Method, "path", r.URL.Path, "user", userOf(r))
	return &apiError{status: http.StatusInternalServerError, code: codeInternal, message: "internal error; the server's log has the details"}
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
