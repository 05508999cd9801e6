package console

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// get sends GET url with token as a bearer token ("" for none) on a
// connection of its own, and returns the status and the body.
func get(t *testing.T, url, token string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
	res, err := client.Do(req)
	require.NoError(t, err)
	defer func() { _ = res.Body.Close() }()
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(body)
}

// TestMount: Mount serves the console at Config.Prefix+"/" of the
// service's mux, behind its Auth, next to the service's own routes; a
// Config New refuses registers nothing.
func TestMount(t *testing.T) {
	db := testenv.Schema(t)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	require.NoError(t, Mount(mux, Config{DB: db, Auth: BearerToken(testToken), Prefix: "/eo"}))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	code, _ := get(t, srv.URL+"/eo/api/v1/parked", "")
	require.Equal(t, http.StatusUnauthorized, code, "no token")
	code, _ = get(t, srv.URL+"/eo/api/v1/parked", "wrong-token-0123456789")
	require.Equal(t, http.StatusUnauthorized, code, "another token")
	code, body := get(t, srv.URL+"/eo/api/v1/parked", testToken)
	require.Equal(t, http.StatusOK, code, body)
	code, body = get(t, srv.URL+"/healthz", "")
	require.Equal(t, http.StatusOK, code)
	require.Equal(t, "ok", body, "the service's own route is left as it was")
	code, _ = get(t, srv.URL+"/elsewhere", testToken)
	require.Equal(t, http.StatusNotFound, code, "nothing else is mounted")

	// A trailing slash in Prefix mounts at the same place.
	slash := http.NewServeMux()
	require.NoError(t, Mount(slash, Config{DB: db, Auth: BearerToken(testToken), Prefix: "/ops/"}))
	srv2 := httptest.NewServer(slash)
	defer srv2.Close()
	code, body = get(t, srv2.URL+"/ops/api/v1/parked", testToken)
	require.Equal(t, http.StatusOK, code, body)

	// New's error, and the mux left untouched.
	refused := http.NewServeMux()
	require.ErrorContains(t, Mount(refused, Config{DB: db, Prefix: "/eo"}), "Config.Auth is required")
	srv3 := httptest.NewServer(refused)
	defer srv3.Close()
	code, _ = get(t, srv3.URL+"/eo/api/v1/parked", testToken)
	require.Equal(t, http.StatusNotFound, code, "a refused Config mounts nothing")
	require.Error(t, Mount(nil, Config{DB: db, Auth: BearerToken(testToken)}))
}

// freeAddr returns a loopback address no one listens on (just now).
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close())
	return addr
}

// TestListenAndServe: the server answers (the console, behind its token)
// until ctx is done; then ListenAndServe lets the request in progress
// finish, returns nil only after it did, and the address is free again.
// An address in use is an error at once; a ctx already done, nil.
func TestListenAndServe(t *testing.T) {
	db := testenv.Schema(t)
	mux := http.NewServeMux()
	require.NoError(t, Mount(mux, Config{DB: db, Auth: BearerToken(testToken), Prefix: "/eo"}))
	started, release := make(chan struct{}), make(chan struct{})
	mux.HandleFunc("GET /slow", func(w http.ResponseWriter, _ *http.Request) {
		close(started)
		<-release
		_, _ = io.WriteString(w, "finished")
	})
	addr := freeAddr(t)
	srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- ListenAndServe(ctx, srv) }()

	testenv.Eventually(t, 10*time.Second, func() bool {
		c, err := net.Dial("tcp", addr)
		if err == nil {
			_ = c.Close()
		}
		return err == nil
	}, "the server listening")
	code, _ := get(t, "http://"+addr+"/eo/api/v1/parked", "")
	require.Equal(t, http.StatusUnauthorized, code)
	code, body := get(t, "http://"+addr+"/eo/api/v1/parked", testToken)
	require.Equal(t, http.StatusOK, code, body)

	slow := make(chan string, 1)
	go func() { // no require off the test's goroutine
		client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
		res, err := client.Get("http://" + addr + "/slow")
		if err != nil {
			slow <- err.Error()
			return
		}
		b, err := io.ReadAll(res.Body)
		_ = res.Body.Close()
		if err != nil {
			slow <- err.Error()
			return
		}
		slow <- string(b)
	}()
	<-started
	cancel()
	select {
	case err := <-done:
		t.Fatalf("ListenAndServe returned (%v) while a request was in progress", err)
	case <-time.After(300 * time.Millisecond):
	}
	close(release)
	require.Equal(t, "finished", <-slow, "the request in progress finished")
	select {
	case err := <-done:
		require.NoError(t, err, "a shutdown by ctx")
	case <-time.After(10 * time.Second):
		t.Fatal("ListenAndServe did not return after its ctx was done")
	}
	_, err := net.Dial("tcp", addr)
	require.Error(t, err, "the server no longer listens")

	// An address in use: its error, at once.
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = busy.Close() }()
	err = ListenAndServe(context.Background(), &http.Server{Addr: busy.Addr().String(), Handler: mux, ReadHeaderTimeout: time.Second})
	require.ErrorContains(t, err, "address already in use")

	// A ctx already done: nil, without serving.
	over, stop := context.WithCancel(context.Background())
	stop()
	require.NoError(t, ListenAndServe(over, &http.Server{Addr: freeAddr(t), Handler: mux, ReadHeaderTimeout: time.Second}))
	require.Error(t, ListenAndServe(context.Background(), nil))
}
