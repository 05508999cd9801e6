package main

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp "github.com/rabbitmq/amqp091-go"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/outbox"
	"github.com/exactlyonce/watermill-exactlyonce/rabbitmq"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The wake section: commit-to-consumer latency of events written at a
// steady rate (cfg.wakeRate events/s, each in its own transaction through
// an outbox.Writer's Publisher) and relayed to RabbitMQ by outbox.Relay with
// rabbitmq.Publisher, with wake-on-commit (the default) and with polling
// only (NoListen, the default PollInterval of 100ms). Latency is from the
// return of the producer's COMMIT to the delivery of the message to a
// consumer of the queue (so it includes the broker's hop to the consumer,
// a fraction of a millisecond here). Each round runs both variants, in
// alternating order; the per-round p50 and p99 are the line's values.
//
// A second pair of lines is the writers' cost of the NOTIFY: cfg.wakeWriters
// goroutines commit one-row outbox transactions as fast as they can for
// cfg.wakeWriteTime, through outbox.Publisher (debounced NOTIFY) and through
// the same INSERT without it.

type wakeVariant string

const (
	wakeOnCommit wakeVariant = "wake-on-commit"
	wakePolling  wakeVariant = "polling (100 ms)"
)

func (h *harness) wakeSection(ctx context.Context) ([]*line, error) {
	cfg := h.cfg
	pool, err := newPool(ctx, cfg.dbURL, 16, "")
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	pub, err := rabbitmq.NewPublisher(rabbitmq.PublisherConfig{URL: cfg.amqpURL})
	if err != nil {
		return nil, err
	}
	defer func() { _ = pub.Close() }()

	p50 := map[wakeVariant][]float64{}
	p99 := map[wakeVariant][]float64{}
	variants := []wakeVariant{wakeOnCommit, wakePolling}
	for r := range cfg.rounds {
		var parts []string
		for i := range variants {
			v := variants[(i+r)%len(variants)]
			lat, err := h.wakeRound(ctx, pool, pub, v)
			if err != nil {
				return nil, fmt.Errorf("round %d, %s: %w", r+1, v, err)
			}
			a, b := percentile(lat, 0.50), percentile(lat, 0.99)
			p50[v] = append(p50[v], a)
			p99[v] = append(p99[v], b)
			parts = append(parts, fmt.Sprintf("%s p50 %.1f ms p99 %.1f ms max %.1f ms (%d events)", v, a, b, slices.Max(lat), len(lat)))
		}
		logf("wake round %d/%d: %s", r+1, cfg.rounds, strings.Join(parts, "; "))
	}

	writes := map[string][]float64{}
	for r := range cfg.rounds {
		for _, notify := range []bool{r%2 == 0, r%2 != 0} {
			rate, err := h.writeRound(ctx, pool, notify)
			if err != nil {
				return nil, fmt.Errorf("write round %d: %w", r+1, err)
			}
			k := "plain"
			if notify {
				k = "notify"
			}
			writes[k] = append(writes[k], rate)
		}
		logf("write round %d/%d: Publisher %.0f tx/s, plain INSERT %.0f tx/s", r+1, cfg.rounds, writes["notify"][r], writes["plain"][r])
	}

	at := fmt.Sprintf("%d events/s, commit → consumer", cfg.wakeRate)
	return []*line{
		{name: at + ", p50", aName: string(wakeOnCommit), bName: string(wakePolling), a: p50[wakeOnCommit], b: p50[wakePolling], unit: "ms",
			target: "A ≤ 5 ms, B ≥ 50 ms", check: func(a, b, _ float64) bool { return a <= 5 && b >= 50 }},
		{name: at + ", p99", aName: string(wakeOnCommit), bName: string(wakePolling), a: p99[wakeOnCommit], b: p99[wakePolling], unit: "ms",
			target: "A ≤ 25 ms", check: func(a, _, _ float64) bool { return a <= 25 }},
		{name: fmt.Sprintf("one-row outbox transactions, %d writers", cfg.wakeWriters), aName: "outbox.Publisher (debounced NOTIFY)", bName: "the same INSERT, no NOTIFY",
			a: writes["notify"], b: writes["plain"], unit: "tx/s", target: "A/B ≥ 0.95", check: func(_, _, r float64) bool { return r >= 0.95 }},
	}, nil
}

// wakeRound runs one variant for cfg.wakeTime and returns the latencies in
// milliseconds.
func (h *harness) wakeRound(ctx context.Context, pool *pgxpool.Pool, pub *rabbitmq.Publisher, v wakeVariant) ([]float64, error) {
	cfg := h.cfg
	h.seq++
	db, err := h.newSchema(ctx, fmt.Sprintf("wake%d", h.seq))
	if err != nil {
		return nil, err
	}
	db.Conn = wsql.BeginnerFromPgx(pool)
	q, err := h.newQueue(fmt.Sprintf("wake%d", h.seq))
	if err != nil {
		return nil, err
	}

	// The consumer records when each message arrives.
	ch, err := h.amqp.Channel()
	if err != nil {
		return nil, err
	}
	defer func() { _ = ch.Close() }()
	deliveries, err := ch.Consume(q, "", true, false, false, false, nil)
	if err != nil {
		return nil, err
	}
	var mu sync.Mutex
	arrived := map[string]time.Time{}
	consumed := make(chan struct{})
	go func() {
		defer close(consumed)
		for d := range deliveries {
			now := time.Now()
			mu.Lock()
			arrived[messageID(d)] = now
			mu.Unlock()
		}
	}()

	relay, err := outbox.NewRelay(outbox.RelayConfig{DB: db, Publisher: pub, NoListen: v == wakePolling, Logger: watermill.NopLogger{}})
	if err != nil {
		return nil, err
	}
	rctx, stop := context.WithCancel(ctx)
	relayDone := make(chan error, 1)
	go func() { relayDone <- relay.Run(rctx) }()
	defer func() {
		stop()
		if err := <-relayDone; err != nil {
			logf("wake: relay: %v", err)
		}
	}()
	if v == wakeOnCommit {
		for deadline := time.Now().Add(10 * time.Second); !relay.Stats().Listening; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				return nil, fmt.Errorf("the relay did not listen within 10s")
			}
		}
	}

	// The producer: one transaction per event, at a steady rate.
	w, err := outbox.NewWriter(db)
	if err != nil {
		return nil, err
	}
	n := int(cfg.wakeTime.Seconds() * float64(cfg.wakeRate))
	committed := make(map[string]time.Time, n)
	tick := time.NewTicker(time.Second / time.Duration(cfg.wakeRate))
	defer tick.Stop()
	for i := range n {
		<-tick.C
		id := fmt.Sprintf("wake-%s-%s-%d", h.id, sanitize(string(v)), i)
		tx, err := db.Conn.BeginTx(ctx, nil)
		if err != nil {
			return nil, err
		}
		p, err := w.Publisher(tx)
		if err != nil {
			_ = tx.Rollback()
			return nil, err
		}
		if err := p.Publish(q, message.NewMessage(id, benchPayload)); err != nil {
			_ = tx.Rollback()
			return nil, err
		}
		if err := tx.Commit(); err != nil {
			return nil, err
		}
		committed[id] = time.Now()
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		mu.Lock()
		got := len(arrived)
		mu.Unlock()
		if got >= n {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%d of %d events arrived", got, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	_ = ch.Close()
	<-consumed
	lat := make([]float64, 0, n)
	for id, c := range committed {
		a, ok := arrived[id]
		if !ok {
			return nil, fmt.Errorf("event %s never arrived", id)
		}
		lat = append(lat, math.Max(0, float64(a.Sub(c).Microseconds())/1000))
	}
	return lat, nil
}

// messageID is the Watermill UUID of a delivery (rabbitmq.Marshaler puts it
// in message_id).
func messageID(d amqp.Delivery) string {
	if d.MessageId != "" {
		return d.MessageId
	}
	if v, ok := d.Headers["_watermill_message_uuid"].(string); ok {
		return v
	}
	return ""
}

// writeRound commits one-row outbox transactions from cfg.wakeWriters
// goroutines for cfg.wakeWriteTime and returns the transactions per second:
// through outbox.Publisher (notify) or the same INSERT without the NOTIFY.
func (h *harness) writeRound(ctx context.Context, pool *pgxpool.Pool, notify bool) (float64, error) {
	cfg := h.cfg
	h.seq++
	db, err := h.newSchema(ctx, fmt.Sprintf("write%d", h.seq))
	if err != nil {
		return 0, err
	}
	db.Conn = wsql.BeginnerFromPgx(pool)
	w, err := outbox.NewWriter(db)
	if err != nil {
		return 0, err
	}
	var count atomic.Int64
	var firstErr atomic.Value
	stopAt := time.Now().Add(cfg.wakeWriteTime)
	var wg sync.WaitGroup
	start := time.Now()
	for n := range cfg.wakeWriters {
		wg.Go(func() {
			for i := 0; time.Now().Before(stopAt); i++ {
				if err := writeOne(ctx, db, w, fmt.Sprintf("w%d-%d", n, i), notify); err != nil {
					firstErr.CompareAndSwap(nil, err)
					return
				}
				count.Add(1)
			}
		})
	}
	wg.Wait()
	if err, _ := firstErr.Load().(error); err != nil {
		return 0, err
	}
	return float64(count.Load()) / time.Since(start).Seconds(), nil
}

// writeOne commits one outbox row through w (notify) or the same INSERT
// without the NOTIFY.
func writeOne(ctx context.Context, db sqlschema.DB, w *outbox.Writer, id string, notify bool) error {
	tx, err := db.Conn.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if notify {
		p, err := w.Publisher(tx)
		if err == nil {
			err = p.Publish("t", message.NewMessage(id, benchPayload))
		}
		if err != nil {
			_ = tx.Rollback()
			return err
		}
	} else if _, err := tx.ExecContext(ctx, "INSERT INTO "+db.Outbox()+" (topic, uuid, payload, metadata) VALUES ($1,$2,$3,$4::jsonb)", "t", id, benchPayload, "{}"); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

// percentile is the p-quantile of v (nearest rank).
func percentile(v []float64, p float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	s := slices.Clone(v)
	slices.Sort(s)
	i := int(math.Ceil(p*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}
