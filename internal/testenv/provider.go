package testenv

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
)

// Provider is an HTTP server standing in for an external provider (an SMS
// gateway): POST /messages with an Idempotency-Key header and a JSON body.
// It counts calls and successes per idempotency key. Decide answers per
// request with OnRequest (default: 200).
type Provider struct {
	srv *httptest.Server

	mu        sync.Mutex
	calls     map[string]int
	successes map[string]int
	bodies    map[string][]byte

	// OnRequest, when set, is called for every request with its key and the
	// number of this call for the key (1 for the first); it returns the HTTP
	// status to answer. It may block (on r.Context() to notice a client that
	// went away). Set it before the first request, or with SetOnRequest.
	OnRequest func(r *http.Request, key string, call int) int
}

// NewProvider starts a Provider on loopback, closed at cleanup.
func NewProvider(t testing.TB) *Provider {
	t.Helper()
	p := &Provider{calls: map[string]int{}, successes: map[string]int{}, bodies: map[string][]byte{}}
	p.srv = httptest.NewServer(http.HandlerFunc(p.serve))
	t.Cleanup(p.srv.Close)
	return p
}

// URL is the provider's base URL; clients POST to URL()+"/messages".
func (p *Provider) URL() string { return p.srv.URL }

func (p *Provider) serve(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/messages" {
		http.Error(w, "not found", http.StatusNotFound)
		return
	}
	key := r.Header.Get("Idempotency-Key")
	if key == "" {
		http.Error(w, "missing Idempotency-Key", http.StatusBadRequest)
		return
	}
	body, _ := io.ReadAll(r.Body)
	p.mu.Lock()
	p.calls[key]++
	call := p.calls[key]
	onRequest := p.OnRequest
	p.mu.Unlock()

	status := http.StatusOK
	if onRequest != nil {
		status = onRequest(r, key, call)
	}
	if r.Context().Err() != nil {
		return // the client went away: not a success it could see
	}
	if status >= 200 && status < 300 {
		p.mu.Lock()
		p.successes[key]++
		p.bodies[key] = body
		p.mu.Unlock()
	}
	w.WriteHeader(status)
}

// Calls returns how many requests carried key.
func (p *Provider) Calls(key string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.calls[key]
}

// Successes returns how many requests with key were answered 2xx.
func (p *Provider) Successes(key string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.successes[key]
}

// AllCalls returns a copy of the calls per key.
func (p *Provider) AllCalls() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.calls)
}

// AllSuccesses returns a copy of the successes per key.
func (p *Provider) AllSuccesses() map[string]int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return maps.Clone(p.successes)
}

// SendSMS is a minimal client: it posts {"to","text"} with the
// idempotency key, and returns an error unless the answer is 2xx.
func SendSMS(ctx context.Context, client *http.Client, baseURL, idempotencyKey, to, text string) error {
	body, _ := json.Marshal(map[string]string{"to": to, "text": text})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, baseURL+"/messages", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", idempotencyKey)
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer func() { _ = resp.Body.Close() }()
	_, _ = io.Copy(io.Discard, resp.Body)
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		return fmt.Errorf("provider answered %s", resp.Status)
	}
	return nil
}

// SetOnRequest replaces OnRequest safely while requests may be in flight.
func (p *Provider) SetOnRequest(f func(r *http.Request, key string, call int) int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.OnRequest = f
}
