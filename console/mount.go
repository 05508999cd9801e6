package console

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"time"
)

// Mount creates the console (New) and registers it on mux at cfg.Prefix+"/"
// ("/" when Prefix is empty), where New's handler must be mounted: it
// serves the overview at Prefix+"/" and the API under Prefix+"/api/v1/",
// with the full request paths (no http.StripPrefix). The service's other
// routes on mux stay as they are. It returns New's error, and then
// registers nothing. Like mux.Handle, it panics when the pattern is
// already registered on mux.
//
//	mux := http.NewServeMux()
//	mux.Handle("GET /metrics", promhttp.Handler())
//	err := console.Mount(mux, console.Config{DB: db, Auth: console.BearerToken(os.Getenv("CONSOLE_TOKEN")), Prefix: "/exactlyonce"})
func Mount(mux *http.ServeMux, cfg Config) error {
	if mux == nil {
		return errors.New("console: Mount: the mux is nil")
	}
	h, err := New(cfg)
	if err != nil {
		return err
	}
	mux.Handle(strings.TrimSuffix(cfg.Prefix, "/")+"/", h)
	return nil
}

// shutdownTimeout is how long ListenAndServe waits, once its context is
// done, for the requests in progress to finish (http.Server.Shutdown)
// before it closes their connections (http.Server.Close).
const shutdownTimeout = 10 * time.Second

// ListenAndServe runs srv, the HTTP server the console is mounted on
// (with /metrics, say), for as long as ctx: it calls srv.ListenAndServe,
// and when ctx is done it shuts srv down (srv.Shutdown: no new
// connections, the requests in progress finish, for at most
// 10 seconds, then srv.Close) and returns once that is over. It
// returns nil after a shutdown (by ctx, or by a Shutdown or Close of
// yours), and srv.ListenAndServe's error otherwise (the address is in
// use, say) at once. In a closure, it runs next to the relay and the
// router:
//
//	relay.RunWith(ctx, router.Run, func(ctx context.Context) error { return console.ListenAndServe(ctx, srv) })
func ListenAndServe(ctx context.Context, srv *http.Server) error {
	if srv == nil {
		return errors.New("console: ListenAndServe: the server is nil")
	}
	shutdown := make(chan struct{})
	stop := context.AfterFunc(ctx, func() {
		defer close(shutdown)
		wait, cancel := context.WithTimeout(context.WithoutCancel(ctx), shutdownTimeout)
		defer cancel()
		if srv.Shutdown(wait) != nil {
			_ = srv.Close()
		}
	})
	err := srv.ListenAndServe()
	if !stop() { // ctx is done: the shutdown has started, wait for its end
		<-shutdown
	}
	if errors.Is(err, http.ErrServerClosed) {
		return nil
	}
	return err
}
