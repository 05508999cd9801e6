package tests

// Helpers of the lease-mode end-to-end tests (lease_test.go): an SMS sender
// handler calling the fake provider of testenv, the lease-mode middleware
// and routers, and a subscriber that drops nacked messages. Identifiers
// start with "lease".

import (
	"encoding/json"
	"errors"
	"net/http"
	"regexp"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

const (
	// leaseConsumer is the inbox consumer name of every router of a lease
	// test: they are replicas of one SMS service.
	leaseConsumer = "sms-sender"
	// leaseDuration is Config.Lease: far longer than any handler run of
	// these tests (the holder test blocks one for about a second), so no
	// lease expires and no attempt is ever Interrupted.
	leaseDuration = 30 * time.Second
	// leaseNackDelay is Config.NackDelay: short, so that the nacks of busy
	// copies (another router holds the key) cost the tests little time.
	leaseNackDelay = 50 * time.Millisecond
)

// leaseIdemKey is the idempotency key lease mode gives the handler (and the
// handler gives the provider) for message key: "<consumer>:<key>", as
// Info.IdempotencyKey documents.
func leaseIdemKey(key string) string { return leaseConsumer + ":" + key }

// leaseSMS is the payload of an incoming "send an SMS" message.
type leaseSMS struct {
	To   string `json:"to"`
	Text string `json:"text"`
}

// leasePayload returns the JSON payload of the i-th SMS of a test.
func leasePayload(i int) []byte {
	b, _ := json.Marshal(leaseSMS{To: "+4670" + strconv.Itoa(1000000+i), Text: "your code is " + strconv.Itoa(i)})
	return b
}

// leaseRun is one run of the SMS handler: the lease information it got and
// the router handler that ran it.
type leaseRun struct {
	Info    exactlyonce.Info
	Handler string
}

// leaseSender is the handler under test, an SMS sender in lease mode: it
// reads its Info, calls the provider with the attempt's idempotency
// key, and on success writes an effect row through the completion
// transaction and returns a "sent" output message (UUID outputUUID(key,
// attempt)). A provider error is returned as is (the router nacks, RabbitMQ
// redelivers), except a 4xx answer, which retrying cannot fix: it is
// wrapped with exactlyonce.Permanent (the key is parked and the message
// acked).
type leaseSender struct {
	e        *e2e
	provider *testenv.Provider
	client   *http.Client

	mu   sync.Mutex
	runs map[string][]leaseRun
}

// newLeaseSender returns the sender of bundle e, calling provider.
func newLeaseSender(t testing.TB, e *e2e, provider *testenv.Provider) *leaseSender {
	t.Helper()
	transport := &http.Transport{MaxIdleConns: 32, MaxIdleConnsPerHost: 32, IdleConnTimeout: waitTimeout}
	t.Cleanup(transport.CloseIdleConnections)
	return &leaseSender{
		e:        e,
		provider: provider,
		client:   &http.Client{Transport: transport, Timeout: waitTimeout},
		runs:     map[string][]leaseRun{},
	}
}

// leaseProviderStatus finds the HTTP status in testenv.SendSMS's error.
var leaseProviderStatus = regexp.MustCompile(`provider answered (\d{3})`)

// leaseIsRejection reports whether err is a 4xx answer of the provider.
func leaseIsRejection(err error) bool {
	m := leaseProviderStatus.FindStringSubmatch(err.Error())
	if m == nil {
		return false
	}
	code, _ := strconv.Atoi(m[1])
	return code >= 400 && code < 500
}

// Handle is the message.HandlerFunc.
func (s *leaseSender) Handle(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	info, err := exactlyonce.InfoFromContext(ctx)
	if err != nil {
		return nil, err
	}
	if info.Attempt == 0 {
		return nil, errors.New("no lease attempt in the handler's context: not running in lease mode")
	}
	s.mu.Lock()
	s.runs[msg.UUID] = append(s.runs[msg.UUID], leaseRun{Info: info, Handler: message.HandlerNameFromCtx(ctx)})
	s.mu.Unlock()

	var sms leaseSMS
	if err := json.Unmarshal(msg.Payload, &sms); err != nil {
		return nil, exactlyonce.Permanent(err)
	}
	if err := testenv.SendSMS(ctx, s.client, s.provider.URL(), info.IdempotencyKey, sms.To, sms.Text); err != nil {
		if leaseIsRejection(err) {
			return nil, exactlyonce.Permanent(err)
		}
		return nil, err
	}
	if err := s.e.Effects.Insert(ctx, msg.UUID, info.Attempt); err != nil {
		return nil, err
	}
	out, _ := json.Marshal(map[string]any{"key": msg.UUID, "attempt": info.Attempt, "status": "sent"})
	return []*message.Message{message.NewMessage(outputUUID(msg.UUID, info.Attempt), out)}, nil
}

// Runs returns a copy of the handler runs of key, in order.
func (s *leaseSender) Runs(key string) []leaseRun {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]leaseRun(nil), s.runs[key]...)
}

// Keys returns the number of keys the handler ran for, and the number of
// runs.
func (s *leaseSender) Keys() (keys, runs int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, r := range s.runs {
		runs += len(r)
	}
	return len(s.runs), runs
}

// leaseMiddleware returns a lease-mode middleware on bundle e (consumer
// leaseConsumer, lease leaseDuration, NackDelay leaseNackDelay) reporting to
// e.Log and then to also, when not nil. Each router gets its own, as each
// replica of a service would.
func leaseMiddleware(t testing.TB, e *e2e, also func(exactlyonce.Event)) *exactlyonce.Guard {
	t.Helper()
	return e.Middleware(t, exactlyonce.Config{
		Lease:     &exactlyonce.LeaseConfig{Duration: leaseDuration},
		Consumer:  leaseConsumer,
		NackDelay: leaseNackDelay,
		OnEvent:   also,
	})
}

// leaseStartRouter starts a router whose one handler, named name, consumes
// e.In through sub with a fresh lease-mode middleware, publishing to e.Out
// (the outbox destination). deliveries records what RabbitMQ delivered to
// it.
func leaseStartRouter(t testing.TB, e *e2e, name string, sub message.Subscriber, h message.HandlerFunc, deliveries *deliveryLog) *message.Router {
	t.Helper()
	r := newRouter(t)
	r.AddMiddleware(deliveries.Middleware, leaseMiddleware(t, e, nil).Middleware)
	r.AddHandler(name, e.In, sub, e.Out, outboxOnly(t), h)
	testenv.StartRouter(t, r)
	return r
}

// leaseDroppingSubscriber is a watermill-amqp subscriber like
// testenv.AMQPSubscriber whose nacks do not requeue: a nacked message is
// gone from the queue.
func leaseDroppingSubscriber(t testing.TB, prefetch int) message.Subscriber {
	t.Helper()
	cfg := wamqp.NewDurableQueueConfig(testenv.AMQPURL())
	cfg.Consume.Qos.PrefetchCount = prefetch
	cfg.Consume.NoRequeueOnNack = true
	sub, err := wamqp.NewSubscriber(cfg, watermill.NopLogger{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = sub.Close() })
	return sub
}
