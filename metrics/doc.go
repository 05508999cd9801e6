// Package metrics exports the library's events and state as Prometheus
// metrics (github.com/prometheus/client_golang). The core packages do not
// import it: a service that does not use Prometheus does not pull it in.
//
// A typical service (a middleware, an outbox, a relay) in one call, served
// on its own registry:
//
//	reg := prometheus.NewRegistry() // or leave Registerer nil: prometheus.DefaultRegisterer, promhttp.Handler()
//	m, err := metrics.New(metrics.Config{Registerer: reg, Outbox: db, Relays: []*outbox.Relay{relay}})
//	eo, err := exactlyonce.New(exactlyonce.Config{DB: db, OnEvent: m.OnEvent})
//	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
//
// The methods watch the rest, and what exists only after New:
//
//	err = m.WatchRelay(relay)      // the relay's counters, read at scrape
//	err = m.WatchOutbox(db)        // the outbox backlog, queried at scrape
//	err = m.WatchInbox(store)      // inbox rows by status, queried at most once per Config.InboxInterval
//	err = m.WatchRedisStore(redisStore, "send-sms") // the Redis lease store's parked keys, likewise
//	n, err := store.Purge(ctx, inbox.PurgeOptions{OlderThan: 14 * 24 * time.Hour, Progress: m.ObservePurge})
//
// To keep a hook of your own next to OnEvent, call both:
//
//	OnEvent: func(e exactlyonce.Event) { m.OnEvent(e); mine(e) },
//
// # Metrics
//
// The names below are those of the default namespace, "exactlyonce";
// Config.Namespace replaces that prefix (and then the dashboard and alert
// rules of docs/operations/ need the same change). Labels are bounded: the
// consumer name (the inbox consumer, by default the router handler's name),
// an outcome, a reason, a status. Never a key or a message UUID.
//
// From OnEvent, one update per delivery:
//
//	exactlyonce_deliveries_total{consumer,outcome}            counter    deliveries by Event.Outcome: processed, duplicate (blocked), parked, nacked, fail_open
//	exactlyonce_delivery_errors_total{consumer,reason}        counter    deliveries whose error went back to the router (nacked, or a failed fail-open run), by reason (below)
//	exactlyonce_delivery_duration_seconds{consumer,outcome}   histogram  time in the middleware, handler included (Event.Duration)
//	exactlyonce_claim_duration_seconds{consumer}              histogram  time of the inbox check (Event.ClaimDuration), when one ran; its _count is the number of claims
//	exactlyonce_batch_size{consumer}                          histogram  deliveries per group-commit batch (Event.BatchSize), observed once per batch (Event.BatchFirst)
//	exactlyonce_lease_takeovers_total{consumer}               counter    lease-mode attempts that took over a key whose previous attempt was interrupted (Event.Interrupted)
//	exactlyonce_keys_parked_total{consumer}                   counter    keys this process parked for an operator (a Parked event with Event.Err set)
//
// The reason label of exactlyonce_delivery_errors_total is one of:
//
//	invalid_key     ErrInvalidKey: no usable key or consumer name
//	db_unavailable  ErrDBUnavailable: the database could not be reached (before the handler, or at a lease-mode completion)
//	claim_failed    ErrClaimFailed: any other database error before the handler ran
//	lease_held      ErrLeaseHeld: another worker holds the key's lease
//	lease_lost      ErrLeaseLost: the lease was taken over before this attempt completed
//	no_destination  ErrNoDestination: output messages without a topic
//	panic           the handler panicked (Watermill's middleware.RecoveredPanicError)
//	handler_error   anything else: the handler's own error, or a commit that failed after it ran
//
// From WatchRelay, read from Relay.Stats at scrape and summed over the
// watched relays:
//
//	exactlyonce_relay_relayed_total            counter  messages published and deleted from the outbox
//	exactlyonce_relay_batches_total            counter  batches committed that relayed a message or recorded a failure
//	exactlyonce_relay_failed_batches_total     counter  batches that returned an error (RelayStats.Failures)
//	exactlyonce_relay_failed_publishes_total   counter  failed publishes of a message (each failure of a row counts)
//	exactlyonce_relay_quarantined_total        counter  rows this process quarantined
//	exactlyonce_relay_listening                gauge    watched relays holding their wake-on-commit LISTEN (0 on MySQL)
//
// From WatchOutbox, one outbox.Store.Pending query per scrape (bounded by
// Config.ScrapeTimeout; it counts the outbox table, which holds only rows not
// relayed yet):
//
//	exactlyonce_outbox_pending_rows                gauge    rows not relayed yet, quarantined ones included
//	exactlyonce_outbox_failing_rows                gauge    rows not quarantined whose publish failed at least once
//	exactlyonce_outbox_quarantined_rows            gauge    rows the relay gave up on, waiting for outbox.Store.RequeueFailed
//	exactlyonce_outbox_blocked_keys                gauge    ordering keys with a failing or quarantined row (their later rows wait)
//	exactlyonce_outbox_blocked_rows                gauge    rows waiting behind a failing or quarantined row of their ordering key
//	exactlyonce_outbox_oldest_pending_age_seconds  gauge    age of the oldest row not quarantined (the relay lag); 0 when none
//	exactlyonce_outbox_scrape_errors_total         counter  Store.Pending queries that failed; the gauges are then absent from that scrape
//
// From WatchInbox, inbox.Store.Stats, at most once per Config.InboxInterval
// (Stats scans the inbox table, or a consumer's part of it: on a table of
// millions of rows each query takes a while, so the values are cached and
// may be up to that interval old):
//
//	exactlyonce_inbox_rows{consumer,status}  gauge    records by status: processing, done, failed, parked (parked keys wait for an operator)
//	exactlyonce_inbox_scrape_errors_total    counter  Stats queries that failed; the gauges are then absent until the next successful query
//
// From WatchRedisStore, redisstore.Store.CountParkedKeys per consumer, at
// most once per Config.InboxInterval (each count reads the consumer's
// parked set and the status of each member):
//
//	exactlyonce_redis_parked_keys{consumer}  gauge    parked keys of the Redis lease store (keys waiting for an operator)
//	exactlyonce_redis_scrape_errors_total    counter  counts that failed; the gauges are then absent until the next successful count
//
// From ObservePurge (inbox.PurgeOptions.Progress):
//
//	exactlyonce_inbox_purged_rows_total               counter  inbox records removed by retention purges
//	exactlyonce_inbox_last_purge_timestamp_seconds    gauge    Unix time of the last purge progress report (absent before the first)
//
// docs/operations.md lists the same, with the alert rules
// (docs/operations/alerts.yml) and the Grafana dashboard
// (docs/operations/grafana-dashboard.json) built on them.
package metrics
