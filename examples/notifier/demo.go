package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
)

// demoNames are the schema and queues of a demo run; all of them are
// dropped or deleted when it ends.
type demoNames struct {
	schema, send, sent, dead string
}

var defaultDemoNames = demoNames{
	schema: "notifier_demo",
	send:   "demo.notifications.send",
	sent:   "demo.notifications.sent",
	dead:   "demo.notifications.send.dead",
}

// demoFigures is what a demo run measured.
type demoFigures struct {
	Published int // send requests published, the malformed one included
	Distinct  int // distinct notifications among them
	Copies    int // extra copies of a notification (same message_id)
	Malformed int // malformed requests published

	DeadLettered int // messages that ended in the dead-letter queue
	Deliveries   int // deliveries of valid requests that reached the send handler
	Redeliveries int // of which RabbitMQ redeliveries (beyond the copies published)
	Duplicates   int // deliveries the inbox acked as duplicates

	ProviderKeys     int // distinct idempotency keys the providers saw
	ProviderRequests int // requests the providers got: SMS and e-mails sent
	LogRows          int // notification_log rows
	Events           int // notification.sent events relayed to the sent queue
}

// exactlyOnce reports whether every notification was sent, logged and
// announced once, and the malformed request dead-lettered.
func (f demoFigures) exactlyOnce() bool {
	return f.ProviderKeys == f.Distinct && f.ProviderRequests == f.Distinct && f.LogRows == f.Distinct &&
		f.Events == f.Distinct && f.DeadLettered == f.Malformed
}

// errLostAck is the demo's simulated lost ack: the send committed, then the
// delivery is reported failed, so RabbitMQ redelivers it.
var errLostAck = errors.New("demo: simulated lost ack after the notification was sent")

type demoSample struct {
	id, channel, to, text string
	copies                int // times published
}

var demoSamples = []demoSample{
	{"n-1001", "sms", "+380501112233", "Your code is 4821", 3},
	{"n-1002", "sms", "+380671234567", "Your order #77 has shipped", 2},
	{"n-1003", "email", "ada@example.com", "Welcome aboard, Ada!", 2},
	{"n-1004", "sms", "+380931112200", "Payment received: 120 UAH", 1},
	{"n-1005", "email", "grace@example.com", "Your invoice is ready", 2},
	{"n-1006", "sms", "+380991234000", "Reminder: appointment at 10:00", 1},
}

// lostAckID is the message whose first delivery loses its ack.
const lostAckID = "msg-n-1004"

// runDemo runs the demo on its own schema and queues, prints what it
// measured, and removes everything it created.
func runDemo(ctx context.Context, logger *slog.Logger, out io.Writer) error {
	cfg, err := LoadConfig()
	if err != nil {
		return err
	}
	f, err := demo(ctx, logger, cfg, defaultDemoNames)
	if err != nil {
		return err
	}
	printDemo(out, engineName(dialectOf(cfg.DatabaseURL)), f)
	if !f.exactlyOnce() {
		return errors.New("expected exactly one send, one log row and one event per notification")
	}
	return nil
}

// demo starts a notifier (cfg, with the built-in fake providers) on the given
// schema and queues, and publishes send requests the way a non-Watermill
// producer would (plain AMQP, message_id set): first each notification once
// and one malformed request, with the ack of one delivery lost after its
// send (RabbitMQ redelivers it); then extra copies of some notifications, as
// a producer's retries. Copies of one notification are never in flight
// together, so every figure is the same on every run. It stops the notifier,
// drops the schema and deletes the queues, also when it fails.
func demo(ctx context.Context, logger *slog.Logger, cfg Config, names demoNames) (fig demoFigures, err error) {
	cfg.HTTPAddr = "127.0.0.1:0"
	cfg.Schema = names.schema
	cfg.SendQueue, cfg.SentQueue, cfg.DeadQueue = names.send, names.sent, names.dead
	cfg.SMSProviderURL, cfg.EmailProviderURL = "", ""
	cfg.Relay = true

	// Start from nothing (a run killed half-way leaves its tables behind),
	// and leave nothing.
	_ = cleanUpDemo(cfg)
	defer func() {
		if cerr := cleanUpDemo(cfg); cerr != nil {
			err = errors.Join(err, fmt.Errorf("cleaning up the demo: %w", cerr))
		}
	}()

	conn, err := amqp.Dial(cfg.AMQPURL)
	if err != nil {
		return fig, fmt.Errorf("RabbitMQ at %s: %w (run `make services`)", cfg.AMQPURL, err)
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return fig, err
	}
	if err := ch.Confirm(false); err != nil {
		return fig, err
	}

	deliveries := &deliveryCounter{perMessage: map[string]int{}}
	svc, err := newService(ctx, cfg, logger, hooks{outer: deliveries.middleware, expected: []error{errLostAck}})
	if err != nil {
		return fig, err
	}
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	done := make(chan error, 1)
	go func() { done <- svc.Run(runCtx) }()
	running := true
	stopService := func() error {
		if !running {
			return nil
		}
		running = false
		stopRun()
		return <-done
	}
	defer func() { _ = stopService() }()

	published := map[string]int{} // copies published per message_id
	publish := func(messageID string, body []byte) error {
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", cfg.SendQueue, false, false, amqp.Publishing{
			MessageId: messageID, ContentType: "application/json", DeliveryMode: amqp.Persistent, Body: body,
		})
		if err != nil {
			return err
		}
		if ok, err := dc.WaitContext(ctx); err != nil || !ok {
			return fmt.Errorf("RabbitMQ did not confirm a publish: %w", err)
		}
		published[messageID]++
		fig.Published++
		return nil
	}
	request := func(s demoSample) []byte {
		body, _ := json.Marshal(SendRequest{NotificationID: s.id, Channel: s.channel, To: s.to, Text: s.text})
		return body
	}

	sentMsgs, err := ch.Consume(cfg.SentQueue, "", true, false, false, false, nil)
	if err != nil {
		return fig, err
	}
	sent := map[string]int{} // notification.sent events per notification_id
	take := func(d amqp.Delivery) {
		var ev SentEvent
		if json.Unmarshal(d.Body, &ev) == nil {
			sent[ev.NotificationID]++
		}
		fig.Events++
	}
	metric := func(outcome string) int {
		v, _ := svc.metrics.counter("exactlyonce_deliveries_total", map[string]string{"consumer": sendConsumer, "outcome": outcome})
		return int(v)
	}
	deadDepth := func() int {
		q, err := ch.QueueDeclarePassive(cfg.DeadQueue, true, false, false, false, nil)
		if err != nil {
			return -1
		}
		return q.Messages
	}
	wait := func(what string, cond func() bool) error {
		deadline := time.After(30 * time.Second)
		for !cond() {
			select {
			case d := <-sentMsgs:
				take(d)
			case <-deadline:
				return fmt.Errorf("demo timed out waiting for %s (processed %d, duplicates %d, dead-lettered %d, events %d)",
					what, metric("processed"), metric("duplicate"), deadDepth(), fig.Events)
			case err := <-done:
				running = false
				return fmt.Errorf("notifier stopped: %w", err)
			case <-time.After(20 * time.Millisecond):
			}
		}
		return nil
	}

	// 1. Each notification once, and a malformed request. The first delivery
	// of lostAckID loses its ack after the send: RabbitMQ redelivers it.
	for _, s := range demoSamples {
		if err := publish("msg-"+s.id, request(s)); err != nil {
			return fig, err
		}
	}
	if err := publish("msg-broken", []byte(`{"notification_id": "n-9999", "channel": "pigeon"}`)); err != nil {
		return fig, err
	}
	fig.Malformed = 1
	if err := wait("each notification sent once and the malformed request dead-lettered", func() bool {
		return metric("processed") == len(demoSamples) && metric("duplicate") == 1 && deadDepth() == 1
	}); err != nil {
		return fig, err
	}

	// 2. The producer's retries: extra copies of notifications already sent.
	for round := 1; round < 3; round++ {
		for _, s := range demoSamples {
			if round < s.copies {
				if err := publish("msg-"+s.id, request(s)); err != nil {
					return fig, err
				}
			}
		}
	}
	valid := fig.Published - fig.Malformed
	if err := wait("every copy handled", func() bool {
		return metric("duplicate") == valid-len(demoSamples)+1 && deliveries.total() == valid+1
	}); err != nil {
		return fig, err
	}
	if err := wait("one event per notification relayed", func() bool {
		p, err := svc.pendingCtx(ctx)
		return err == nil && p.Count == 0 && len(sent) == len(demoSamples)
	}); err != nil {
		return fig, err
	}
	time.Sleep(300 * time.Millisecond) // let a stray repeated event show, if there were one
	for drained := false; !drained; {
		select {
		case d := <-sentMsgs:
			take(d)
		default:
			drained = true
		}
	}

	fig.Distinct = len(demoSamples)
	fig.Copies = valid - fig.Distinct
	fig.DeadLettered = deadDepth()
	fig.Deliveries = deliveries.total()
	fig.Redeliveries = deliveries.beyond(published)
	fig.Duplicates = metric("duplicate")
	for _, f := range svc.fakes {
		k, r := f.Sent()
		fig.ProviderKeys += k
		fig.ProviderRequests += r
	}
	if _, err := queryRow(ctx, svc.db.Conn, svc.st["CountLog"], nil, &fig.LogRows); err != nil {
		return fig, err
	}
	return fig, stopService()
}

// deliveryCounter counts the deliveries of valid requests that reach the
// send handler, per message, and loses the ack of lostAckID's first one.
type deliveryCounter struct {
	mu         sync.Mutex
	perMessage map[string]int
}

func (c *deliveryCounter) middleware(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if _, err := parseRequest(msg.Payload); err != nil || msg.UUID == "" {
			return h(msg) // dead-lettered: no handler, with or without the library
		}
		c.mu.Lock()
		c.perMessage[msg.UUID]++
		first := c.perMessage[msg.UUID] == 1
		c.mu.Unlock()
		out, err := h(msg)
		if errors.Is(err, exactlyonce.ErrLeaseHeld) {
			// Held back while another worker had the key, and redelivered:
			// an artefact of the lease, not a delivery of its own.
			c.mu.Lock()
			c.perMessage[msg.UUID]--
			c.mu.Unlock()
		}
		if err == nil && first && msg.UUID == lostAckID {
			return nil, errLostAck
		}
		return out, err
	}
}

func (c *deliveryCounter) total() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, d := range c.perMessage {
		n += d
	}
	return n
}

// beyond counts the deliveries beyond the copies published of each message:
// RabbitMQ's redeliveries.
func (c *deliveryCounter) beyond(published map[string]int) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for id, d := range c.perMessage {
		n += max(0, d-published[id])
	}
	return n
}

// printDemo prints the figures of a run on engine (engineName) in
// two aligned columns.
func printDemo(w io.Writer, engine string, f demoFigures) {
	rows := []struct {
		label string
		value string
	}{
		{"send requests published (plain AMQP, message_id set)", fmt.Sprint(f.Published)},
		{"  distinct notifications", fmt.Sprint(f.Distinct)},
		{"  extra copies of a notification (same message_id)", fmt.Sprint(f.Copies)},
		{"  malformed, dead-lettered with the reason", fmt.Sprint(f.DeadLettered)},
		{"deliveries of valid requests to the send consumer", fmt.Sprint(f.Deliveries)},
		{"  among them, redeliveries by RabbitMQ (an ack lost after the send)", fmt.Sprint(f.Redeliveries)},
		{"  acked by the inbox as duplicates: the send handler did not run", fmt.Sprint(f.Duplicates)},
		{"  ran the send handler (deliveries - duplicates)", fmt.Sprint(f.Deliveries - f.Duplicates)},
		{"provider calls (distinct idempotency keys / requests)", fmt.Sprintf("%d / %d", f.ProviderKeys, f.ProviderRequests)},
		{"notification_log rows", fmt.Sprint(f.LogRows)},
		{"notification.sent events relayed", fmt.Sprint(f.Events)},
	}
	lw, vw := 0, 0
	for _, r := range rows {
		lw, vw = max(lw, len(r.label)), max(vw, len(r.value))
	}
	_, _ = fmt.Fprintln(w)
	_, _ = fmt.Fprintf(w, "watermill-exactlyonce notifier demo (lease mode on %s, fake SMS and e-mail providers)\n", engine)
	for _, r := range rows {
		_, _ = fmt.Fprintf(w, "  %-*s  %*s\n", lw, r.label, vw, r.value)
	}
	_, _ = fmt.Fprintf(w, "  without the library, %d SMS/e-mails would have gone out (one per delivery); with it, %d did.\n",
		f.Deliveries, f.ProviderRequests)
	if f.exactlyOnce() {
		_, _ = fmt.Fprintln(w, "  every notification was sent exactly once.")
	}
	_, _ = fmt.Fprintln(w)
	_, _ = fmt.Fprintln(w, "where to look in a running service:")
	for _, l := range whereToLook {
		_, _ = fmt.Fprintf(w, "  %-12s %s\n", l[0], l[1])
	}
}

// whereToLook is the demo's last block: the operator's tools.
var whereToLook = [][2]string{
	{"metrics", "GET /metrics on HTTP_ADDR (default 127.0.0.1:8080): the metrics package's series, names in docs/operations.md#metrics"},
	{"dashboard", "docs/operations/grafana-dashboard.json (Grafana, any Prometheus data source)"},
	{"alerts", "docs/operations/alerts.yml (Prometheus rules: duplicates, claim errors, relay lag, quarantined rows, parked keys)"},
	{"CLI", "go run github.com/exactlyonce/watermill-exactlyonce/cmd/exactlyonce inbox stats"},
}

// cleanUpDemo drops the demo's schema and deletes its queues, best-effort:
// it tries everything and returns what failed.
func cleanUpDemo(cfg Config) error {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	var errs []error
	if err := dropSchema(ctx, cfg); err != nil {
		errs = append(errs, err)
	}
	conn, err := amqp.Dial(cfg.AMQPURL)
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	defer func() { _ = conn.Close() }()
	for _, q := range []string{cfg.SendQueue, cfg.SentQueue, cfg.DeadQueue} {
		ch, err := conn.Channel() // a failed delete closes its channel
		if err != nil {
			errs = append(errs, err)
			break
		}
		if _, err := ch.QueueDelete(q, false, false, false); err != nil && !isNotFound(err) {
			errs = append(errs, fmt.Errorf("deleting queue %s: %w", q, err))
		}
		_ = ch.Close()
	}
	return errors.Join(errs...)
}

// dropSchema drops the demo's schema (on MySQL, its database) with
// everything in it.
func dropSchema(ctx context.Context, cfg Config) error {
	if cfg.Schema == "" {
		return errors.New("the demo has no schema of its own") // never the connection's database
	}
	conn, err := openDatabase(ctx, cfg.DatabaseURL, 1)
	if err != nil {
		return err
	}
	defer conn.close()
	db := conn.conn
	db.Schema = cfg.Schema
	st, err := loadStatements(db)
	if err != nil {
		return err
	}
	_, err = db.Conn.ExecContext(ctx, st["DropSchema"])
	return err
}

func isNotFound(err error) bool {
	var ae *amqp.Error
	return errors.As(err, &ae) && (ae.Code == amqp.NotFound || strings.Contains(ae.Reason, "NOT_FOUND"))
}
