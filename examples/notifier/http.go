package main

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

func (s *Service) routes() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/healthz", s.healthz)
	mux.Handle("/metrics", promhttp.HandlerFor(s.metrics.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/webhooks/receipts", s.handleReceipt)
	// Read-only admin API.
	mux.HandleFunc("GET /admin/inbox/stats", s.adminInboxStats)
	mux.HandleFunc("GET /admin/inbox/record", s.adminInboxRecord)
	mux.HandleFunc("GET /admin/inbox/parked", s.adminInboxParked)
	mux.HandleFunc("GET /admin/outbox/stats", s.adminOutboxStats)
	return mux
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func (s *Service) healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
	defer cancel()
	status := map[string]string{"database": "ok", "router": "ok"}
	code := http.StatusOK
	if err := s.ping(ctx); err != nil {
		status["database"] = err.Error()
		code = http.StatusServiceUnavailable
	}
	if !s.routerRunning() {
		status["router"] = "not running"
		code = http.StatusServiceUnavailable
	}
	writeJSON(w, code, status)
}

func (s *Service) adminInboxStats(w http.ResponseWriter, r *http.Request) {
	st, err := s.store.Stats(r.Context(), r.URL.Query().Get("consumer"))
	if err != nil {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, st)
}

func (s *Service) adminInboxRecord(w http.ResponseWriter, r *http.Request) {
	consumer, key := r.URL.Query().Get("consumer"), r.URL.Query().Get("key")
	if consumer == "" {
		consumer = sendConsumer
	}
	rec, err := s.store.Get(r.Context(), consumer, key)
	switch {
	case errors.Is(err, inbox.ErrNotFound):
		writeJSON(w, http.StatusNotFound, map[string]string{"error": err.Error()})
	case err != nil:
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": err.Error()})
	default:
		writeJSON(w, http.StatusOK, rec)
	}
}

func (s *Service) adminInboxParked(w http.ResponseWriter, r *http.Request) {
	limit, _ := strconv.Atoi(r.URL.Query().Get("limit"))
	recs, err := s.store.Parked(r.Context(), r.URL.Query().Get("consumer"), limit)
	if err != nil {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": err.Error()})
		return
	}
	if recs == nil {
		recs = []inbox.Record{}
	}
	writeJSON(w, http.StatusOK, recs)
}

func (s *Service) adminOutboxStats(w http.ResponseWriter, r *http.Request) {
	p, err := s.pending()
	if err != nil {
		writeJSON(w, http.StatusServiceUnavailable, map[string]string{"error": err.Error()})
		return
	}
	out := map[string]any{
		"pending":                    p.Count,
		"oldest_pending_age_seconds": p.OldestAge.Seconds(),
		"relay_in_process":           s.relay != nil,
	}
	if s.relay != nil {
		st := s.relay.Stats()
		out["relayed"] = st.Relayed
		out["relay_failures"] = st.Failures
	}
	writeJSON(w, http.StatusOK, out)
}

// pending reads the outbox backlog (outbox.Store.Pending) for the admin API.
func (s *Service) pending() (outbox.Pending, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return s.pendingCtx(ctx)
}

// pendingCtx reads the outbox backlog.
func (s *Service) pendingCtx(ctx context.Context) (outbox.Pending, error) {
	rows, err := outbox.NewStore(s.db)
	if err != nil {
		return outbox.Pending{}, err
	}
	return rows.Pending(ctx)
}
