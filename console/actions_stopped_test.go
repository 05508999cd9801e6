package console

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// failAfter is a publisher that accepts n messages, then refuses every
// other one until fixed.
type failAfter struct {
	mu    sync.Mutex
	n     int
	fixed bool
	sent  int
}

func (p *failAfter) Publish(_ string, msgs ...*message.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.fixed && p.sent+len(msgs) > p.n {
		return errors.New("broker refused the publish")
	}
	p.sent += len(msgs)
	return nil
}

func (p *failAfter) Close() error { return nil }

func (p *failAfter) fix() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fixed = true
}

// failOutboxInsert makes the outbox refuse the row of uuid (a trigger),
// until the returned function is called.
func failOutboxInsert(t *testing.T, e *tenv, uuid string) func() {
	t.Helper()
	fn := e.db.Schema + ".eo_refuse_" + strconv.FormatInt(time.Now().UnixNano(), 36)
	_, err := e.db.Conn.ExecContext(e.ctx, `CREATE FUNCTION `+fn+`() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN IF NEW.uuid = '`+uuid+`' THEN RAISE EXCEPTION 'refused by the test'; END IF; RETURN NEW; END $$`)
	require.NoError(t, err)
	_, err = e.db.Conn.ExecContext(e.ctx, `CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON `+e.db.Outbox()+` FOR EACH ROW EXECUTE FUNCTION `+fn+`()`)
	require.NoError(t, err)
	return func() {
		_, err := e.db.Conn.ExecContext(e.ctx, `DROP TRIGGER refuse ON `+e.db.Outbox())
		require.NoError(t, err)
	}
}

// A bulk action that stops part-way answers how many it did and where to
// resume: the API with done and resume (the rest, counted again, with its
// bounds), the pages with a confirmation of the rest; confirming it goes
// on with exactly the rest.
func TestBulkActionStoppedPartWay(t *testing.T) {
	t.Parallel()

	t.Run("api replay, postgres", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		const n = 101 // the store replays 100 per transaction: the second one fails
		for i := range n {
			e.park("c", fmt.Sprintf("k%03d", i), pmsg{topic: "orders"})
		}
		unfail := failOutboxInsert(t, e, "uuid-k100")
		c := ok(t, e.get("/eo/api/v1/parked/count?consumer=c"))
		body := map[string]any{"consumer": "c", "expect": c["count"], "as_of": c["as_of"]}
		w := e.call("POST", "/eo/api/v1/parked/replay", body)
		require.Equal(t, http.StatusInternalServerError, w.Code, "%s", w.Body)
		var eb errorBody
		require.NoError(t, json.Unmarshal(w.Body.Bytes(), &eb))
		require.NotNil(t, eb.Error.Done)
		require.EqualValues(t, 100, *eb.Error.Done, "the first transaction's")
		require.NotNil(t, eb.Error.Resume)
		require.EqualValues(t, 1, eb.Error.Resume.Count, "the rest")
		require.Contains(t, eb.Error.Message, "stopped after replayed 100 messages")
		require.EqualValues(t, n-1, testenv.Count(t, e.db.Conn, `SELECT count(*) FROM `+e.db.Outbox()))

		unfail()
		m := ok(t, e.call("POST", "/eo/api/v1/parked/replay", map[string]any{"consumer": "c", "expect": eb.Error.Resume.Count,
			"as_of": eb.Error.Resume.AsOf.Format(time.RFC3339Nano)}))
		require.EqualValues(t, 1, m["replayed"])
		require.EqualValues(t, n, testenv.Count(t, e.db.Conn, `SELECT count(*) FROM `+e.db.Outbox()))
	})

	t.Run("api requeue, outbox rows", func(t *testing.T) {
		t.Parallel()
		e := newEnv(t)
		// 501 quarantined rows: requeued 500 per statement.
		_, err := e.db.Conn.ExecContext(e.ctx, `INSERT INTO `+e.db.Outbox()+` (topic, uuid, payload, metadata, failures, attempts, last_error, quarantined_at)
SELECT 'orders', 'r' || g, '{}', '{}', 5, 5, 'too large', now() FROM generate_series(1, 501) g`)
		require.NoError(t, err)
		unfail := failOutboxInsert(t, e, "r501")
		c := ok(t, e.get("/eo/api/v1/outbox/rows/count?state=quarantined"))
		w := e.call("POST", "/eo/api/v1/outbox/rows/requeue", map[string]any{"state": "quarantined", "all": true, "expect": c["count"], "as_of": c["as_of"], "max_id": c["max_id"]})
		require.Equal(t, http.StatusInternalServerError, w.Code, "%s", w.Body)
		var eb errorBody
		require.NoError(t, json.Unmarshal(w.Body.Bytes(), &eb))
		require.EqualValues(t, 500, *eb.Error.Done)
		require.EqualValues(t, 1, eb.Error.Resume.Count)
		require.NotNil(t, eb.Error.Resume.MaxID)

		unfail()
		m := ok(t, e.call("POST", "/eo/api/v1/outbox/rows/requeue", map[string]any{"state": "quarantined", "all": true, "expect": eb.Error.Resume.Count,
			"as_of": eb.Error.Resume.AsOf.Format(time.RFC3339Nano), "max_id": *eb.Error.Resume.MaxID}))
		require.EqualValues(t, 1, m["requeued"])
	})

	t.Run("page replay, redis", func(t *testing.T) {
		t.Parallel()
		r := newRedis(t)
		pub := &failAfter{n: 2}
		e := newEnv(t, func(c *Config) { c.Redis, c.RedisReplayPublisher = r.store, pub })
		for i := range 5 {
			r.park(t, e.ctx, "send-sms", fmt.Sprintf("s%d", i), pmsg{topic: "sms"})
		}
		post := func(action string, v url.Values) string {
			t.Helper()
			return e.call("POST", action, v, "Sec-Fetch-Site", "same-origin").Body.String()
		}
		body := page(t, e.call("POST", "/eo/parked/replay", url.Values(map[string][]string{"store": {"redis"}, "consumer": {"send-sms"}}),
			"Sec-Fetch-Site", "same-origin"), http.StatusOK)
		require.Equal(t, "This replays 5 messages.", text(t, body, "confirm-count"))
		action, v := form(t, body, "confirm-form")
		w := e.call("POST", action, v, "Sec-Fetch-Site", "same-origin")
		require.Equal(t, http.StatusInternalServerError, w.Code, "%s", w.Body)
		body = w.Body.String()
		require.Contains(t, text(t, body, "count-changed"), "Replayed 2 messages, then stopped")
		require.Equal(t, "This replays 3 messages.", text(t, body, "confirm-count"), "the rest, to confirm")

		pub.fix()
		action, v = form(t, body, "confirm-form")
		body = post(action, v)
		require.Equal(t, "Done: Replayed 3 messages.", text(t, body, "result"))
	})
}
