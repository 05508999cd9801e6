// Package console is an admin HTTP API and a web console for a running
// exactly-once system: see and fix it from a browser or a script.
//
// One http.Handler (New) serves both, under the path it is mounted at
// (Config.Prefix):
//
//   - the JSON admin API under Prefix+"/api/v1/": the overview (per
//     consumer: records by status, duplicates dropped, parked keys and
//     messages; the outbox's backlog, oldest pending age, failing and
//     quarantined rows; the relays the database can tell about), a
//     consumer's figures, a key's record and forgetting it, parked
//     messages and quarantined outbox rows with the search, show, replay
//     (requeue) and discard of the dead-letter loop, one at a time or in
//     bulk with the count the operator confirmed;
//   - the web console's pages under Prefix+"/": the overview (refreshed
//     every 5 seconds by a small script; every page works without it),
//     the parked messages and the quarantined rows with search, a message
//     page (payload, metadata, reason, attempts, times), replay and
//     discard through a confirmation that states how many messages the
//     action touches, and an inbox lookup by key. The assets are embedded;
//     there is no build step.
//
// It works on the PostgreSQL inbox and outbox (Config.DB, through the
// inbox and outbox packages' operator functions) and on the Redis lease
// store (Config.Redis, a *redisstore.Store, with ?store=redis), as the
// exactlyonce CLI does; `exactlyonce ui` serves it standalone. The package
// imports no Redis client: Config.Redis is an interface (RedisStore), so a
// service that mounts the console over PostgreSQL alone has none in its
// build or its go.mod.
//
// Mount it on your own mux, as riverui does:
//
//	h, err := console.New(console.Config{
//		DB:     db, // the services' sqlschema.DB
//		Prefix: "/exactlyonce",
//		Auth:   console.BearerToken(os.Getenv("EXACTLYONCE_UI_TOKEN")),
//	})
//	mux.Handle("/exactlyonce/", h)
//
// or in one call, on an *http.ServeMux (Mount registers it at Prefix+"/"),
// and serve that mux until the service stops (ListenAndServe, a graceful
// shutdown when its context ends; in a closure, it runs in
// outbox.Relay.RunWith next to the relay and the router):
//
//	err := console.Mount(mux, console.Config{DB: db, Prefix: "/exactlyonce", Auth: console.BearerToken(os.Getenv("CONSOLE_TOKEN"))})
//	err = console.ListenAndServe(ctx, &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second})
//
// # Security
//
// Nothing is served without an authentication decision: New requires an
// Authenticator (BearerToken: a token for the API and a login form that
// sets an HttpOnly, SameSite=Strict cookie for browsers, which expires
// after Config.SessionTTL; BearerTokens: a token per named user;
// BasicAuth; or AuthFunc over the identity your own middleware put in the
// request's context), or Config.InsecureNoAuth, which logs a warning and answers
// only to the loopback's names and Config.AllowedHosts (a page of
// another site whose name resolves to the loopback, DNS rebinding, is
// refused). Tokens and passwords are at least 16 bytes long, and a client
// address that failed to sign in Config.SignInFailures times within
// Config.SignInWindow (10 in 15 minutes) is answered 429 until the window
// has passed. Only the style sheet, the script and the login form are
// public. An action (POST,
// DELETE) must come from the console's own origin
// (http.CrossOriginProtection; Config.TrustedOrigins for a proxy), with
// a JSON body said so on the API (a form or text/plain post is refused,
// 415), and is refused in Config.ReadOnly mode; GETs change nothing. Actions are
// logged (Config.Logger) with the user, the address, what was done and on
// how many. Pages are html/template (everything shown is escaped;
// payloads are text, or base64 when not UTF-8), answers carry a strict
// Content-Security-Policy, and every database access goes through the
// stores' parameterised functions.
//
// # Cost
//
// The overview's figures count the inbox (inbox.Store.Stats scans each
// consumer's part of it): they are computed in the background at most
// every Config.StatsInterval and served from memory, so the overview
// answers in well under a millisecond whatever the table's size; answers
// say when the figures were computed ("as_of"). Searches use the stores'
// indexes (the Redis store reads a consumer's parked set).
//
// docs/console.md lists every endpoint with examples, the error codes and
// what each page shows.
package console
