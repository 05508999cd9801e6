package exactlyonce_test

// A parked message keeps its content: whichever way the middleware parks a
// key (transactional Permanent, group commit, lease mode's Permanent,
// interruptions and completions that can never commit, on either lease
// store), the message is kept with the park, as it was consumed: its UUID,
// payload, metadata and topic, with the reason and attempts.

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// keptMessage is what a park kept of a message, read from either store.
type keptMessage struct {
	UUID, Topic string
	Payload     []byte
	PayloadKept bool
	PayloadSize int
	Metadata    map[string]string
	Reason      string
	Attempts    int
}

// keptInPostgres reads the parked message of (consumer, key) from the
// table of parked messages; false when there is none. On either engine
// (db.Dialect): the name says it is the SQL store's, not Redis's.
func keptInPostgres(t *testing.T, db sqlschema.DB, consumer, key string) (keptMessage, bool) {
	t.Helper()
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
	require.NoError(t, err)
	var k keptMessage
	var meta string
	metadata, query := "metadata::text", testenv.MySQLPlaceholders
	if db.Dialect != sqlschema.MySQL {
		query = func(q string) string { return q }
	} else {
		metadata = "metadata"
	}
	err = seam.QueryRow(context.Background(), db.Conn, query(`SELECT message_uuid, topic, coalesce(payload, ''), payload IS NOT NULL, payload_size,
`+metadata+`, reason, attempts FROM `+store.ParkedTable()+` WHERE consumer = $1 AND message_key = $2`), []any{consumer, key},
		&k.UUID, &k.Topic, &k.Payload, &k.PayloadKept, &k.PayloadSize, &meta, &k.Reason, &k.Attempts)
	if errors.Is(err, seam.ErrNoRows) {
		return keptMessage{}, false
	}
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal([]byte(meta), &k.Metadata))
	return k, true
}

// keptInRedis reads the parked message of (consumer, key) from its record
// (redisstore's layout); false when there is none.
func keptInRedis(t *testing.T, c redis.UniversalClient, prefix, consumer, key string) (keptMessage, bool) {
	t.Helper()
	f, err := c.HGetAll(context.Background(), prefix+"{"+consumer+"}:k:"+key).Result()
	require.NoError(t, err)
	if _, ok := f["m_uuid"]; !ok {
		return keptMessage{}, false
	}
	k := keptMessage{UUID: f["m_uuid"], Topic: f["m_topic"], Reason: f["last_error"]}
	var p string
	p, k.PayloadKept = f["m_payload"]
	k.Payload = []byte(p)
	k.PayloadSize, err = strconv.Atoi(f["m_size"])
	require.NoError(t, err)
	k.Attempts, err = strconv.Atoi(f["attempts"])
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal([]byte(f["m_meta"]), &k.Metadata))
	require.NotEmpty(t, f["parked_at_ms"])
	return k, true
}

// requireKept asserts that got is msg as it was consumed from topic, its
// payload kept.
func requireKept(t *testing.T, got keptMessage, ok bool, msg *message.Message, topic string) {
	t.Helper()
	require.True(t, ok, "the park kept message %s", msg.UUID)
	require.Equal(t, msg.UUID, got.UUID)
	require.Equal(t, topic, got.Topic, "the topic it was consumed from")
	require.True(t, got.PayloadKept)
	require.Equal(t, msg.Payload, message.Payload(got.Payload))
	require.Equal(t, len(msg.Payload), got.PayloadSize)
	require.Equal(t, map[string]string(msg.Metadata), got.Metadata)
}

// parkedOrder is an order message as a producer sends it: a binary-safe
// payload and a business id in its metadata.
func parkedOrder(uuid string) *message.Message {
	msg := message.NewMessage(uuid, []byte(`{"order_id":"o-`+uuid+`"}`+"\x00\xff"))
	msg.Metadata.Set("order_id", "o-"+uuid)
	msg.Metadata.Set("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
	return msg
}

// routed runs h, wrapped by eo, in a Watermill router as handler name,
// subscribed to topic on a Go channel, and returns a function that
// publishes a message to topic and returns once the router acked it. The
// handler's context has the subscribe topic, as in production.
func routed(t *testing.T, name, topic string, eo *exactlyonce.Guard, h message.HandlerFunc) func(*message.Message) {
	t.Helper()
	return routedWith(t, topic, func(r *message.Router, ps *gochannel.GoChannel) *message.Handler {
		return r.AddHandler(name, topic, ps, "unused-"+topic, ps, h)
	}, eo)
}

// routedConsumer is routed for a handler with no publish topic
// (router.AddConsumerHandler), as the Redis lease store requires.
func routedConsumer(t *testing.T, name, topic string, eo *exactlyonce.Guard, h message.NoPublishHandlerFunc) func(*message.Message) {
	t.Helper()
	return routedWith(t, topic, func(r *message.Router, ps *gochannel.GoChannel) *message.Handler {
		return r.AddConsumerHandler(name, topic, ps, h)
	}, eo)
}

func routedWith(t *testing.T, topic string, add func(*message.Router, *gochannel.GoChannel) *message.Handler, eo *exactlyonce.Guard) func(*message.Message) {
	t.Helper()
	ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, watermill.NopLogger{})
	t.Cleanup(func() { _ = ps.Close() })
	r, err := message.NewRouter(message.RouterConfig{}, watermill.NopLogger{})
	require.NoError(t, err)
	add(r, ps).AddMiddleware(eo.Middleware)
	testenv.StartRouter(t, r)
	return func(msg *message.Message) {
		t.Helper()
		done := make(chan error, 1)
		go func() { done <- ps.Publish(topic, msg) }()
		select {
		case err := <-done:
			require.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Fatalf("message %s was not acked within 30s", msg.UUID)
		}
	}
}

// parkLog keeps the error lines a middleware logs.
type parkLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *parkLog) Error(msg string, err error, _ watermill.LogFields) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.lines = append(l.lines, msg)
}
func (l *parkLog) Info(string, watermill.LogFields)                 {}
func (l *parkLog) Debug(string, watermill.LogFields)                {}
func (l *parkLog) Trace(string, watermill.LogFields)                {}
func (l *parkLog) With(watermill.LogFields) watermill.LoggerAdapter { return l }
func (l *parkLog) requireLine(t *testing.T, parts ...string) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, line := range l.lines {
		found := true
		for _, p := range parts {
			found = found && strings.Contains(line, p)
		}
		if found {
			return
		}
	}
	require.Fail(t, "no log line with every part", "parts %q in %q", parts, l.lines)
}

func TestParkedTransactionalKeepsTheMessage(t *testing.T) {
	t.Parallel()
	testenv.ForEachEngine(t, testenv.Layouts, func(t *testing.T, d testenv.Driver, layout string) {
		db := layoutDB(t, d, layout)
		var ev testenv.Counters
		var log parkLog
		eo, err := exactlyonce.New(exactlyonce.Config{DB: db, NackDelay: -1, OnEvent: ev.Observe, Logger: &log, MaxParkedPayload: 64})
		require.NoError(t, err)
		publish := routed(t, "billing", "orders.created", eo, func(msg *message.Message) ([]*message.Message, error) {
			return nil, exactlyonce.Permanent(errors.New("invalid order " + msg.UUID))
		})

		order := parkedOrder("u-1")
		publish(order)
		got, ok := keptInPostgres(t, db, "billing", "u-1")
		requireKept(t, got, ok, order, "orders.created")
		require.Equal(t, "permanent: invalid order u-1", got.Reason, "the reason is the handler's error")
		require.Equal(t, 1, got.Attempts)
		log.requireLine(t, "exactlyonce parked show billing u-1", "exactlyonce parked replay billing u-1")
		require.NotContains(t, strings.Join(log.lines, "\n"), "--redis-url")

		// Over MaxParkedPayload: the park happens, the message is
		// acked (publish returned), only the size is kept.
		big := parkedOrder("u-2")
		big.Payload = []byte(strings.Repeat("x", 65))
		publish(big)
		got, ok = keptInPostgres(t, db, "billing", "u-2")
		require.True(t, ok)
		require.False(t, got.PayloadKept)
		require.Equal(t, 65, got.PayloadSize)
		require.Equal(t, map[string]string(big.Metadata), got.Metadata, "metadata is always kept")
		require.Equal(t, int64(2), ev.Parked.Load())

		// A redelivery of a parked key changes nothing; Forget
		// deletes what was kept.
		again := parkedOrder("u-1")
		again.Payload = []byte("changed")
		publish(again)
		got, ok = keptInPostgres(t, db, "billing", "u-1")
		requireKept(t, got, ok, order, "orders.created")
		store, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
		require.NoError(t, err)
		forgot, err := store.Forget(context.Background(), db.Conn, "billing", "u-1")
		require.NoError(t, err)
		require.True(t, forgot)
		_, ok = keptInPostgres(t, db, "billing", "u-1")
		require.False(t, ok)
	})
}

// layoutDB is the fresh schema of layout (testenv.Layouts) reached through
// d: on MySQL, whose only layout is the plain one, the bundle's database.
func layoutDB(t *testing.T, d testenv.Driver, layout string) sqlschema.DB {
	t.Helper()
	if d.Dialect == sqlschema.MySQL {
		require.Equal(t, "plain", layout)
		return testenv.NewBundle(t, d).DB
	}
	return testenv.WithConn(testenv.SchemaLayout(t, layout), d.DB)
}

// Group commit: a batch where one handler returns Permanent parks that key
// with its message, and commits the others.
func TestParkedBatchKeepsTheMessage(t *testing.T) {
	t.Parallel()
	testenv.EachEngine(t, func(t *testing.T, b *testenv.Bundle) {
		var ev testenv.Counters
		eo, err := exactlyonce.New(exactlyonce.Config{DB: b.DB, Batch: &exactlyonce.BatchConfig{MaxSize: 8, MaxWait: 200 * time.Millisecond},
			OnEvent: ev.Observe, NackDelay: -1, Logger: testenv.Logger(t)})
		require.NoError(t, err)
		q := testenv.Queue(t, "parked_batch_")
		r, err := message.NewRouter(message.RouterConfig{}, testenv.Logger(t))
		require.NoError(t, err)
		r.AddMiddleware(eo.Middleware)
		r.AddConsumerHandler("billing", q, exactlyonce.ConcurrentSubscriber(testenv.AMQPSubscriber(t, 1), 8), func(msg *message.Message) error {
			if msg.UUID == "m-3" {
				return exactlyonce.Permanent(errors.New("invalid order m-3"))
			}
			return nil
		})
		testenv.StartRouter(t, r)
		pub := testenv.AMQPPublisher(t)
		var sent *message.Message
		for i := range 8 {
			msg := parkedOrder("m-" + strconv.Itoa(i))
			if i == 3 {
				sent = msg.Copy()
			}
			require.NoError(t, pub.Publish(q, msg))
		}
		testenv.Eventually(t, 60*time.Second, func() bool { return ev.Processed.Load()+ev.Parked.Load() >= 8 }, "all deliveries settled")
		require.Equal(t, int64(7), ev.Processed.Load())
		require.Equal(t, int64(1), ev.Parked.Load())
		got, ok := keptInPostgres(t, b.DB, "billing", "m-3")
		// watermill-amqp adds no metadata of its own to a delivered message.
		requireKept(t, got, ok, sent, q)
		require.Equal(t, "permanent: invalid order m-3", got.Reason)
		for _, k := range []string{"m-0", "m-7"} {
			_, ok := keptInPostgres(t, b.DB, "billing", k)
			require.False(t, ok, "a processed key keeps nothing")
		}
	})
}

// The lease-mode paths, on either store.
func TestLeaseStoresParkedKeepTheMessage(t *testing.T) {
	t.Parallel()
	eachLeaseStore(t, func(t *testing.T, s *leaseStore) {
		var log parkLog
		var perm atomic.Bool
		h := func(msg *message.Message) error {
			if perm.Load() {
				return exactlyonce.Permanent(errors.New("invalid phone number"))
			}
			return nil
		}
		eo := s.middleware(t, exactlyonce.Config{Logger: &log, MaxParkedPayload: 64,
			Lease: &exactlyonce.LeaseConfig{Duration: 5 * time.Second, MaxInterruptedAttempts: 1}})
		publish := routedConsumer(t, "sms-handler", "sms.requested", eo, h)

		t.Run("permanent", func(t *testing.T) {
			perm.Store(true)
			defer perm.Store(false)
			order := parkedOrder("k-perm")
			publish(order)
			got, ok := s.kept(t, suiteConsumer, "k-perm")
			requireKept(t, got, ok, order, "sms.requested")
			require.Equal(t, "permanent: invalid phone number", got.Reason)
			require.Equal(t, 1, got.Attempts)
			if s.name == "redis" {
				log.requireLine(t, "exactlyonce parked show --redis-url <redis-url> sms k-perm", "exactlyonce parked replay --redis-url <redis-url> sms k-perm")
			} else {
				log.requireLine(t, "exactlyonce parked show sms k-perm", "exactlyonce parked replay sms k-perm")
			}
		})

		t.Run("interrupted beyond MaxInterruptedAttempts", func(t *testing.T) {
			s.claimElsewhere(t, "k-int", time.Minute)
			s.expire(t, "k-int")
			order := parkedOrder("k-int")
			publish(order)
			got, ok := s.kept(t, suiteConsumer, "k-int")
			requireKept(t, got, ok, order, "sms.requested")
			require.Contains(t, got.Reason, "lease expired during attempt 1")
			require.Equal(t, 1, got.Attempts)
			log.requireLine(t, "lease expired mid-attempt", "exactlyonce parked show", "k-int")
		})

		t.Run("payload over the limit", func(t *testing.T) {
			perm.Store(true)
			defer perm.Store(false)
			big := parkedOrder("k-big")
			big.Payload = []byte(strings.Repeat("x", 65))
			publish(big)
			got, ok := s.kept(t, suiteConsumer, "k-big")
			require.True(t, ok)
			require.Equal(t, "k-big", got.UUID)
			require.False(t, got.PayloadKept)
			require.Equal(t, 65, got.PayloadSize)
			require.Equal(t, map[string]string(big.Metadata), got.Metadata)
			require.Equal(t, inboxdb.StatusParked, s.record(t, "k-big").Status)
		})

		t.Run("processed keeps nothing, forget deletes", func(t *testing.T) {
			publish(parkedOrder("k-ok"))
			_, ok := s.kept(t, suiteConsumer, "k-ok")
			require.False(t, ok)
			forgot, err := s.backend.Forget(context.Background(), suiteConsumer, "k-perm")
			require.NoError(t, err)
			require.True(t, forgot)
			_, ok = s.kept(t, suiteConsumer, "k-perm")
			require.False(t, ok)
		})
	})
}

// A completion that can never commit (PostgreSQL lease store only: the
// Redis store's completion holds no outputs) parks with the message.
func TestLeaseCompletionParkKeepsTheMessage(t *testing.T) {
	t.Parallel()
	testenv.EachDriver(t, func(t *testing.T, b *testenv.Bundle) {
		eo, err := exactlyonce.New(exactlyonce.Config{DB: b.DB, Consumer: "sms", NackDelay: -1, Logger: testenv.Logger(t), Lease: &exactlyonce.LeaseConfig{}})
		require.NoError(t, err)
		publish := routed(t, "sms-handler", "sms.requested", eo, func(msg *message.Message) ([]*message.Message, error) {
			return []*message.Message{nil}, nil // refused by the outbox, on every attempt
		})
		order := parkedOrder("k")
		publish(order)
		got, ok := keptInPostgres(t, b.DB, "sms", "k")
		requireKept(t, got, ok, order, "sms.requested")
		require.Contains(t, got.Reason, "nil message")
	})
}

func TestMaxParkedPayloadConfig(t *testing.T) {
	t.Parallel()
	require.Equal(t, 1<<20, exactlyonce.Config{}.WithDefaults().MaxParkedPayload, "defaults to 1 MiB")
	require.Equal(t, -1, exactlyonce.Config{MaxParkedPayload: -1}.WithDefaults().MaxParkedPayload, "negative: no payload kept")
	db := sqlschema.DB{Conn: testenv.DriverNamed(t, "pgxpool").DB}
	_, err := exactlyonce.New(exactlyonce.Config{DB: db, MaxParkedPayload: 64<<20 + 1})
	require.ErrorContains(t, err, "Config.MaxParkedPayload")
	_, err = exactlyonce.New(exactlyonce.Config{DB: db, MaxParkedPayload: 64 << 20})
	require.NoError(t, err)
}

// The parked log line's commands can be pasted into a shell as they are.
func TestParkedLogLineQuotes(t *testing.T) {
	t.Parallel()
	db := testenv.WithConn(testenv.Schema(t), testenv.DriverNamed(t, "pgxpool").DB)
	var log parkLog
	eo, err := exactlyonce.New(exactlyonce.Config{DB: db, Consumer: "my consumer", NackDelay: -1, Logger: &log,
		Key: func(*message.Message) (string, error) { return "-k'1", nil }})
	require.NoError(t, err)
	_, err = eo.Middleware(func(*message.Message) ([]*message.Message, error) {
		return nil, exactlyonce.Permanent(errors.New("no"))
	})(message.NewMessage("u", nil))
	require.NoError(t, err)
	log.requireLine(t, `exactlyonce parked show -- 'my consumer' '-k'\''1'`, `exactlyonce parked replay -- 'my consumer' '-k'\''1'`)
	got, ok := keptInPostgres(t, db, "my consumer", "-k'1")
	require.True(t, ok)
	require.Empty(t, got.Topic, "outside a router the topic is unknown")
}
