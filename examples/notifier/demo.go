package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
)

// runDemo starts a notifier with the built-in fake providers on demo-only
// queues and tables, publishes sample requests the way a non-Watermill
// producer would (AMQP message_id), including duplicate copies, one
// delivery returned unacked (RabbitMQ redelivers it), one late re-send of a
// notification already sent, and one malformed request; then prints what
// happened and stops.
func runDemo(ctx context.Context, logger *slog.Logger) error {
	cfg, err := LoadConfig()
	if err != nil {
		return err
	}
	cfg.HTTPAddr = "127.0.0.1:0"
	cfg.Schema = "notifier_demo"
	cfg.SendQueue, cfg.SentQueue, cfg.DeadQueue = "demo.notifications.send", "demo.notifications.sent", "demo.notifications.send.dead"
	cfg.SMSProviderURL, cfg.EmailProviderURL = "", ""

	conn, err := amqp.Dial(cfg.AMQPURL)
	if err != nil {
		return fmt.Errorf("RabbitMQ at %s: %w (run `make services`)", cfg.AMQPURL, err)
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	for _, q := range []string{cfg.SendQueue, cfg.SentQueue, cfg.DeadQueue} {
		if _, err := ch.QueueDeclare(q, true, false, false, false, nil); err != nil {
			return err
		}
		if _, err := ch.QueuePurge(q, false); err != nil {
			return err
		}
	}

	svc, err := NewService(ctx, cfg, logger)
	if err != nil {
		return err
	}
	// A fresh demo every run.
	if _, err := svc.pool.Exec(ctx, `TRUNCATE `+svc.logTable+`, `+svc.tables.Inbox()+`, `+svc.tables.Outbox()); err != nil {
		return err
	}

	type sample struct {
		id, channel, to, text string
		copies                int
	}
	samples := []sample{
		{"n-1001", "sms", "+380501112233", "Your code is 4821", 3},
		{"n-1002", "sms", "+380671234567", "Your order #77 has shipped", 1},
		{"n-1003", "email", "ada@example.com", "Welcome aboard, Ada!", 2},
		{"n-1004", "sms", "+380931112200", "Payment received: 120 UAH", 1},
		{"n-1005", "email", "grace@example.com", "Your invoice is ready", 2},
		{"n-1006", "sms", "+380991234000", "Reminder: appointment at 10:00", 1},
	}
	publish := func(messageID string, body []byte) error {
		return ch.PublishWithContext(ctx, "", cfg.SendQueue, false, false, amqp.Publishing{
			MessageId: messageID, ContentType: "application/json", DeliveryMode: amqp.Persistent, Body: body,
		})
	}
	published := 0
	for round := 0; round < 3; round++ {
		for _, s := range samples {
			if round >= s.copies {
				continue
			}
			body, _ := json.Marshal(SendRequest{NotificationID: s.id, Channel: s.channel, To: s.to, Text: s.text})
			if err := publish("msg-"+s.id, body); err != nil {
				return err
			}
			published++
		}
	}
	if err := publish("msg-broken", []byte(`{"notification_id": "n-9999", "channel": "pigeon"}`)); err != nil {
		return err
	}
	// Take one delivery and give it back unacked: RabbitMQ redelivers it.
	if d, ok, err := ch.Get(cfg.SendQueue, false); err != nil {
		return err
	} else if ok {
		if err := d.Nack(false, true); err != nil {
			return err
		}
	}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- svc.Run(runCtx) }()

	sent := map[string]int{}
	sentMsgs, err := ch.Consume(cfg.SentQueue, "", true, false, false, false, nil)
	if err != nil {
		return err
	}
	wait := func(cond func() bool, what string) error {
		deadline := time.After(30 * time.Second)
		for !cond() {
			select {
			case d := <-sentMsgs:
				var ev SentEvent
				if json.Unmarshal(d.Body, &ev) == nil {
					sent[ev.NotificationID]++
				}
			case <-deadline:
				return fmt.Errorf("demo timed out waiting for %s", what)
			case err := <-done:
				return fmt.Errorf("notifier stopped: %w", err)
			case <-time.After(50 * time.Millisecond):
			}
		}
		return nil
	}
	if err := wait(func() bool { return len(sent) == len(samples) }, "one sent event per notification"); err != nil {
		return err
	}
	// A late re-send of a notification that was already sent.
	body, _ := json.Marshal(SendRequest{NotificationID: "n-1002", Channel: "sms", To: "+380671234567", Text: "Your order #77 has shipped"})
	if err := publish("msg-n-1002", body); err != nil {
		return err
	}
	published++
	dups := func() int { return int(counterValue(svc.metrics.duplicates.WithLabelValues(sendConsumer))) }
	if err := wait(func() bool { return dups() >= published-len(samples) }, "the duplicates to be blocked"); err != nil {
		return err
	}
	var dead int
	if q, err := ch.QueueDeclarePassive(cfg.DeadQueue, true, false, false, false, nil); err == nil {
		dead = q.Messages
	}
	keys, requests := 0, 0
	for _, f := range svc.fakes {
		k, r := f.Sent()
		keys += k
		requests += r
	}
	var logRows int
	if err := svc.pool.QueryRow(ctx, `SELECT count(*) FROM `+svc.logTable).Scan(&logRows); err != nil {
		return err
	}
	time.Sleep(300 * time.Millisecond) // let a stray duplicate event show, if there were one
	for drained := false; !drained; {
		select {
		case d := <-sentMsgs:
			var ev SentEvent
			if json.Unmarshal(d.Body, &ev) == nil {
				sent[ev.NotificationID]++
			}
		default:
			drained = true
		}
	}
	events := 0
	for _, n := range sent {
		events += n
	}
	stop()
	if err := <-done; err != nil {
		return err
	}

	fmt.Println()
	fmt.Println("watermill-exactlyonce notifier demo (lease mode, fake SMS and e-mail providers)")
	row := func(label string, v any) { fmt.Printf("  %-52s %v\n", label, v) }
	row("send requests published (AMQP message_id)", published)
	row("  distinct notifications", len(samples))
	row("  one delivery returned unacked, redelivered by RabbitMQ", "yes")
	row("  malformed request (dead-lettered with its reason)", dead)
	row("duplicates blocked by the inbox", dups())
	row("provider sends (distinct idempotency keys / requests)", fmt.Sprintf("%d / %d", keys, requests))
	row("notification_log rows", logRows)
	row("notification.sent events relayed", events)
	if keys != len(samples) || requests != len(samples) || logRows != len(samples) || events != len(samples) {
		return errors.New("expected exactly one send, one log row and one event per notification")
	}
	fmt.Println("  every notification was sent exactly once.")
	return nil
}
