package chaos

// The lease@redis run: the consumers keep lease mode's records in Redis
// (redisstore), so the harness reads its state and checks its invariants
// there. The record layout is redisstore's (see its package doc).

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// redisRecords returns the consumer's records, by message key.
func (h *harness) redisRecords(ctx context.Context) map[string]map[string]string {
	head := h.redisPrefix + "{" + consumerName + "}:k:"
	var keys []string
	iter := h.redis.Scan(ctx, 0, strings.NewReplacer("*", `\*`, "?", `\?`, "[", `\[`).Replace(head)+"*", 1000).Iterator()
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
	}
	require.NoError(h.t, iter.Err())
	cmds := make([]*redis.MapStringStringCmd, len(keys))
	_, err := h.redis.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, k := range keys {
			cmds[i] = p.HGetAll(ctx, k)
		}
		return nil
	})
	require.NoError(h.t, err)
	out := make(map[string]map[string]string, len(keys))
	for i, k := range keys {
		out[strings.TrimPrefix(k, head)] = cmds[i].Val()
	}
	return out
}

func (h *harness) redisState(ctx context.Context) (state, error) {
	st := state{consumer: map[string]int64{}}
	for _, rec := range h.redisRecords(ctx) {
		st.consumer[rec["status"]]++
	}
	var err error
	st.inReady, _, err = queueState(h.conn, h.in)
	return st, err
}

// settledRedis: every key done in Redis, the input queue empty.
func (s state) settledRedis(n int) bool {
	return s.consumer["done"] == int64(n) && len(s.consumer) == 1 && s.inReady == 0
}

// redisLeftovers takes what is left in the input queue once every worker
// stopped: harmless only as a copy of a key already done.
func (h *harness) redisLeftovers(ctx context.Context) (leftIn, badIn, leftOut, badOut int) {
	t := h.t
	testenv.Eventually(t, 30*time.Second, func() bool {
		_, consumers, err := queueState(h.conn, h.in)
		return err == nil && consumers == 0
	}, "queue %s keeps a consumer after the workers stopped", h.in)
	ch, err := h.conn.Channel()
	require.NoError(t, err)
	defer func() { _ = ch.Close() }()
	recs := h.redisRecords(ctx)
	for {
		d, ok, err := ch.Get(h.in, true)
		require.NoError(t, err)
		if !ok {
			return leftIn, badIn, 0, 0
		}
		leftIn++
		if recs[uuidHeader(d)]["status"] != "done" {
			badIn++
		}
	}
}

func uuidHeader(d amqp.Delivery) string {
	key, _ := d.Headers[wamqp.DefaultMessageUUIDHeaderKey].(string)
	return key
}

func (h *harness) redisInvariants(ctx context.Context, settled bool, leftIn, badIn int) *table {
	s, n := h.s, int64(h.s.Messages)
	tb := &table{title: fmt.Sprintf("chaos run: %s seed=%d messages=%d dup-ratio=%.2f faults>=%d consumers=%dx%d handlers (prefetch %d), lease %s, slow %s",
		h.v, s.Seed, s.Messages, s.DupRatio, s.Faults, s.Consumers, s.Handlers, s.Prefetch, s.Lease, s.SlowLease)}

	tb.section("input")
	tb.eq("messages published (copies, broker-confirmed)", h.published.Load(), int64(len(h.copies)))
	tb.info("unique messages", n)
	tb.info("duplicate copies", int64(len(h.copies))-n)
	tb.check("settled (every key done in Redis, input queue empty)", settled, "true", settled)

	tb.section("consumer (" + consumerName + "), records in Redis")
	recs := h.redisRecords(ctx)
	byStatus := map[string]int64{}
	var dups int64
	for _, rec := range recs {
		byStatus[rec["status"]]++
		d, _ := strconv.ParseInt(rec["duplicates"], 10, 64)
		dups += d
	}
	lost, unknown := int64(0), int64(0)
	known := map[string]bool{}
	for _, k := range h.keys {
		known[k] = true
		if recs[k]["status"] != "done" {
			lost++
		}
	}
	for k := range recs {
		if !known[k] {
			unknown++
		}
	}
	tb.eq("records done", byStatus["done"], n)
	tb.eq("messages lost (keys not done)", lost, 0)
	tb.eq("records of unknown keys", unknown, 0)
	tb.eq("records left processing", byStatus["processing"], 0)
	tb.eq("records failed or parked", byStatus["failed"]+byStatus["parked"], 0)
	tb.info("duplicates recorded", dups)
	h.events(tb, "consumer")
	h.leaseInvariants(ctx, tb)
	tb.info("input queue: copies left after the stop (requeued in-flight duplicates)", leftIn)
	tb.eq("input queue: messages left that were not done", int64(badIn), 0)

	h.faultRows(tb)
	return tb
}
