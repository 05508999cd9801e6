package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"
)

// errRejected is a provider's 4xx answer: retrying will not help.
var errRejected = errors.New("provider rejected the message")

// Provider sends one message through an HTTP provider:
// POST {baseURL}/messages, JSON {"to","text"}, header Idempotency-Key.
// 2xx is sent; anything else is a failure.
type Provider struct {
	Name    string
	BaseURL string
	Client  *http.Client
}

// Send posts the message. The idempotency key is the same for every attempt
// of one notification, so a provider that honours it sends once.
func (p Provider) Send(ctx context.Context, idempotencyKey, to, text string) error {
	body, err := json.Marshal(map[string]string{"to": to, "text": text})
	if err != nil {
		return err
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.BaseURL+"/messages", bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", idempotencyKey)
	resp, err := p.Client.Do(req)
	if err != nil {
		return fmt.Errorf("%s provider: %w", p.Name, err)
	}
	defer func() { _ = resp.Body.Close() }()
	msg, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
	switch {
	case resp.StatusCode >= 200 && resp.StatusCode < 300:
		return nil
	case resp.StatusCode >= 400 && resp.StatusCode < 500 && resp.StatusCode != http.StatusTooManyRequests && resp.StatusCode != http.StatusRequestTimeout:
		return fmt.Errorf("%w: %s provider answered %s: %s", errRejected, p.Name, resp.Status, bytes.TrimSpace(msg))
	default:
		return fmt.Errorf("%s provider answered %s: %s", p.Name, resp.Status, bytes.TrimSpace(msg))
	}
}

// fakeProvider is the built-in provider used when no URL is configured: it
// "sends" by logging, and answers a repeated idempotency key with the first
// result, as real providers do.
type fakeProvider struct {
	name   string
	logger *slog.Logger
	srv    *http.Server
	ln     net.Listener

	mu   sync.Mutex
	sent map[string]int // idempotency key -> requests
}

func startFakeProvider(name string, logger *slog.Logger) (*fakeProvider, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("fake %s provider: %w", name, err)
	}
	f := &fakeProvider{name: name, logger: logger, ln: ln, sent: map[string]int{}}
	f.srv = &http.Server{Handler: http.HandlerFunc(f.serve), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = f.srv.Serve(ln) }()
	return f, nil
}

func (f *fakeProvider) URL() string { return "http://" + f.ln.Addr().String() }

func (f *fakeProvider) serve(w http.ResponseWriter, r *http.Request) {
	var body struct{ To, Text string }
	if r.Method != http.MethodPost || r.URL.Path != "/messages" {
		http.NotFound(w, r)
		return
	}
	if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&body); err != nil {
		http.Error(w, "bad JSON", http.StatusBadRequest)
		return
	}
	key := r.Header.Get("Idempotency-Key")
	f.mu.Lock()
	f.sent[key]++
	n := f.sent[key]
	f.mu.Unlock()
	if n == 1 {
		f.logger.Info("fake provider sent", "channel", f.name, "to", body.To, "text", body.Text, "idempotency_key", key)
	} else {
		f.logger.Warn("fake provider got a repeated idempotency key; answering with the first result", "channel", f.name, "idempotency_key", key, "requests", n)
	}
	w.WriteHeader(http.StatusAccepted)
}

// Sent reports how many distinct keys were sent and how many requests came.
func (f *fakeProvider) Sent() (keys, requests int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, n := range f.sent {
		keys++
		requests += n
	}
	return keys, requests
}

func (f *fakeProvider) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return f.srv.Shutdown(ctx)
}
