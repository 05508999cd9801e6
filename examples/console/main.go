// Command console shows how a service mounts the operator console (package
// console) on its own mux: the service's routes stay where they are, and the
// console answers under one prefix, behind a bearer token taken from the
// environment.
//
//	cd examples && CONSOLE_TOKEN=$(openssl rand -hex 32) go run ./console
//
// Then open http://127.0.0.1:8080/admin/exactlyonce/ and log in with the
// token (a browser gets a cookie), or send it as a header:
// curl -H "Authorization: Bearer $CONSOLE_TOKEN" http://127.0.0.1:8080/admin/exactlyonce/parked.
//
// DATABASE_URL and DB_SCHEMA name the database and the schema of the
// service's inbox and outbox (default: examples/gettingstarted's, so that the
// console shows that service); CONSOLE_ADDR is the address to listen on.
package main

import (
	"cmp"
	"context"
	"errors"
	"io"
	"log"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/console"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// prefix is where the console answers on the service's mux.
const prefix = "/admin/exactlyonce"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx)
	stop()
	if err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context) error {
	token := os.Getenv("CONSOLE_TOKEN")
	if token == "" {
		return errors.New("set CONSOLE_TOKEN to the console's token, a long random secret: CONSOLE_TOKEN=$(openssl rand -hex 32)")
	}
	pool, err := pgxpool.New(ctx, cmp.Or(os.Getenv("DATABASE_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		return err
	}
	defer pool.Close()
	db := sqlschema.DB{Conn: wsql.BeginnerFromPgx(pool), Schema: cmp.Or(os.Getenv("DB_SCHEMA"), "payments")}
	if err := sqlschema.Migrate(ctx, db); err != nil { // as the service does at start-up
		return err
	}
	mux, err := newMux(db, token)
	if err != nil {
		return err
	}

	srv := &http.Server{Addr: cmp.Or(os.Getenv("CONSOLE_ADDR"), "127.0.0.1:8080"), Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(shutdown)
	}()
	log.Printf("console at http://%s%s/", srv.Addr, prefix)
	if err := srv.ListenAndServe(); !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// newMux is the service's mux: its own routes, and the console under prefix.
func newMux(db sqlschema.DB, token string) (*http.ServeMux, error) {
	admin, err := console.New(console.Config{DB: db, Auth: console.BearerToken(token), Prefix: prefix})
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
	mux.Handle(prefix+"/", admin)
	return mux, nil
}
