package console

import (
	"context"
	"net/http"
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// preStore is a store of parked messages under test, and what a second
// operator or a delivery does to it behind the console's back.
type preStore struct {
	name string
	q    string // the query of its pages and endpoints
	// park parks key with a message of uuid.
	park func(t *testing.T, key, uuid string)
	// replay replays key's parked message (another operator); the key is
	// then released.
	replay func(t *testing.T, key string)
	// process lets a delivery of a released key run: the key is done.
	process func(t *testing.T, key string)
	// replayed reports whether a message of uuid was replayed.
	replayed func(t *testing.T, uuid string) bool
	// store is the operator's view.
	store interface {
		GetParkedPrefix(ctx context.Context, consumer, key string, maxPayload int) (inbox.ParkedMessage, error)
		Get(ctx context.Context, consumer, key string) (inbox.Record, error)
	}
}

const preConsumer = "ship-order"

func preStores(t *testing.T) map[string]func(t *testing.T) (*tenv, preStore) {
	return map[string]func(t *testing.T) (*tenv, preStore){
		storePostgres: func(t *testing.T) (*tenv, preStore) {
			e := newEnv(t)
			return e, preStore{
				name: storePostgres,
				park: func(t *testing.T, key, uuid string) { e.park(preConsumer, key, pmsg{uuid: uuid, topic: "orders"}) },
				replay: func(t *testing.T, key string) {
					_, err := e.store.ReplayParked(e.ctx, preConsumer, key, inbox.ReplayOptions{})
					require.NoError(t, err)
				},
				process: func(t *testing.T, key string) {
					tx, err := e.db.Conn.BeginTx(e.ctx, nil)
					require.NoError(t, err)
					res, err := e.inner.ClaimTx(e.ctx, tx, preConsumer, key)
					require.NoError(t, err)
					require.True(t, res.Claimed, "the released key runs")
					require.NoError(t, tx.Commit())
				},
				replayed: func(t *testing.T, uuid string) bool { return e.outboxRows("orders", uuid) > 0 },
				store:    e.store,
			}
		},
		storeRedis: func(t *testing.T) (*tenv, preStore) {
			r := newRedis(t)
			pub := &recorder{}
			e := newEnv(t, func(c *Config) { c.Redis, c.RedisReplayPublisher = r.store, pub })
			return e, preStore{
				name: storeRedis, q: "?store=redis",
				park: func(t *testing.T, key, uuid string) {
					r.park(t, e.ctx, preConsumer, key, pmsg{uuid: uuid, topic: "orders"})
				},
				replay: func(t *testing.T, key string) {
					_, err := r.store.ReplayParked(e.ctx, preConsumer, key, &recorder{}, inbox.ReplayOptions{})
					require.NoError(t, err)
				},
				process: func(t *testing.T, key string) { r.done(t, e.ctx, preConsumer, key) },
				replayed: func(t *testing.T, uuid string) bool {
					for _, p := range pub.all() {
						if p.msg.UUID == uuid {
							return true
						}
					}
					return false
				},
				store: r.store,
			}
		},
	}
}

// parkedNow is the UUID of key's parked message now; "" when none.
func (s preStore) parkedNow(t *testing.T, e *tenv, key string) string {
	t.Helper()
	m, err := s.store.GetParkedPrefix(e.ctx, preConsumer, key, 0)
	if err != nil {
		require.ErrorIs(t, err, inbox.ErrNotParked)
		return ""
	}
	return m.UUID
}

func (s preStore) statusNow(t *testing.T, e *tenv, key string) string {
	t.Helper()
	r, err := s.store.Get(e.ctx, preConsumer, key)
	if err != nil {
		require.ErrorIs(t, err, inbox.ErrNotFound)
		return ""
	}
	return r.Status
}

// A confirmed action acts on what the confirmation showed, or refuses
// (409 "changed", nothing done): on both stores, from the pages and the
// API, with a second operator (or a delivery) acting between the
// confirmation and the confirm.
//
//   - discard and replay: the confirmation names message U1; meanwhile U1
//     is replayed and U2, with the same key, parked. The confirm must not
//     touch U2, which nobody saw.
//   - forget: the confirmation shows the key parked; meanwhile it is
//     replayed and processed (done). The confirm must not delete the done
//     record, or the next delivery would run the handler again.
func TestConfirmedActionActsOnWhatItShowed(t *testing.T) {
	t.Parallel()
	for name, setup := range preStores(t) {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			for _, verb := range []string{"discard", "replay"} {
				t.Run("page "+verb+", message replaced after the confirmation", func(t *testing.T) {
					e, s := setup(t)
					s.park(t, "k", "u1")
					msgPage := "/eo/parked/" + preConsumer + "/k" + s.q
					action, v := form(t, page(t, e.get(msgPage), http.StatusOK), verb+"-form")
					body := page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusOK)
					require.Contains(t, text(t, body, "matching"), "message u1")
					action, v = form(t, body, "confirm-form")

					s.replay(t, "k")
					s.park(t, "k", "u2")

					body = page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusConflict)
					require.Contains(t, text(t, body, "result"), "message u2", "the page says what the key holds now")
					require.Equal(t, "u2", s.parkedNow(t, e, "k"), "the message nobody saw is untouched")
					require.False(t, s.replayed(t, "u2"), "and not replayed")

					// Looked at again, it is acted on as shown.
					action, v = form(t, page(t, e.get(msgPage), http.StatusOK), verb+"-form")
					action, v = form(t, page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusOK), "confirm-form")
					page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusOK)
					require.Empty(t, s.parkedNow(t, e, "k"))
				})

				t.Run("page "+verb+", message replaced before the confirmation", func(t *testing.T) {
					e, s := setup(t)
					s.park(t, "k", "u1")
					action, v := form(t, page(t, e.get("/eo/parked/"+preConsumer+"/k"+s.q), http.StatusOK), verb+"-form")

					s.replay(t, "k")
					s.park(t, "k", "u2")

					body := page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusConflict)
					require.Contains(t, text(t, body, "result"), "message u2")
					require.NotContains(t, body, `id="confirm-form"`, "no confirmation of a message the page did not show")
				})

				t.Run("api "+verb+", message replaced after it was read", func(t *testing.T) {
					e, s := setup(t)
					s.park(t, "k", "u1")
					var shown parkedJSON
					decode(t, e.get("/eo/api/v1/parked/"+preConsumer+"/k"+s.q), &shown)
					require.NotEmpty(t, shown.Version)

					s.replay(t, "k")
					s.park(t, "k", "u2")

					path := "/eo/api/v1/parked/" + preConsumer + "/k/" + verb + s.q
					ae := apiErr(t, e.call("POST", path, map[string]any{"version": shown.Version, "uuid": shown.UUID}), http.StatusConflict, codeChanged)
					require.Contains(t, ae.Message, "message u2")
					apiErr(t, e.call("POST", path, map[string]any{"uuid": "u1"}), http.StatusConflict, codeChanged)
					require.Equal(t, "u2", s.parkedNow(t, e, "k"))
					require.False(t, s.replayed(t, "u2"))

					// A script that names what it read now, or nothing, acts.
					var now parkedJSON
					decode(t, e.get("/eo/api/v1/parked/"+preConsumer+"/k"+s.q), &now)
					require.NotEqual(t, shown.Version, now.Version)
					ok(t, e.call("POST", path, map[string]any{"version": now.Version}))
					require.Empty(t, s.parkedNow(t, e, "k"))
				})
			}

			t.Run("page forget, key processed after the confirmation", func(t *testing.T) {
				e, s := setup(t)
				s.park(t, "k", "u1")
				q := url.Values{"consumer": {preConsumer}, "key": {"k"}}
				if s.name == storeRedis {
					q.Set("store", storeRedis)
				}
				body := page(t, e.get("/eo/inbox?"+q.Encode()), http.StatusOK)
				require.Equal(t, "parked", text(t, body, "record-status"))
				action, v := form(t, body, "forget-form")
				action, v = form(t, page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusOK), "confirm-form")

				s.replay(t, "k")
				s.process(t, "k")

				body = page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusConflict)
				require.Contains(t, text(t, body, "result"), "done")
				require.Equal(t, "done", s.statusNow(t, e, "k"), "the done record stays: its next delivery is still a duplicate")
			})

			t.Run("api forget, key processed after it was read", func(t *testing.T) {
				e, s := setup(t)
				s.park(t, "k", "u1")
				var shown recordJSON
				decode(t, e.get("/eo/api/v1/consumers/"+preConsumer+"/keys/k"+s.q), &shown)
				require.Equal(t, "parked", shown.Status)

				s.replay(t, "k")
				s.process(t, "k")

				sep := "?"
				if s.q != "" {
					sep = s.q + "&"
				}
				path := "/eo/api/v1/consumers/" + preConsumer + "/keys/k" + sep
				apiErr(t, e.call("DELETE", path+"version="+shown.Version, nil), http.StatusConflict, codeChanged)
				apiErr(t, e.call("DELETE", path+"status=parked", nil), http.StatusConflict, codeChanged)
				require.Equal(t, "done", s.statusNow(t, e, "k"))

				var now recordJSON
				decode(t, e.get("/eo/api/v1/consumers/"+preConsumer+"/keys/k"+s.q), &now)
				ok(t, e.call("DELETE", path+"version="+now.Version, nil))
				require.Empty(t, s.statusNow(t, e, "k"))
			})
		})
	}
}

// A requeue or discard of an outbox row acts on the failure record the
// confirmation showed: a row requeued by another operator and
// quarantined again meanwhile is refused (409 "changed"), from the pages
// and the API.
func TestConfirmedRowActionActsOnWhatItShowed(t *testing.T) {
	t.Parallel()
	for _, verb := range []string{"requeue", "discard"} {
		t.Run(verb, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t)
			id := e.row("orders", "u1", "{}", nil, "quarantined")
			again := func() {
				t.Helper()
				require.NoError(t, testenv.OutboxStore(t, e.db).Requeue(e.ctx, id, outbox.Expect{}))
				// The relay fails it again for its own reasons and
				// quarantines it (as its failure statement does).
				_, err := e.db.Conn.ExecContext(e.ctx, `UPDATE `+e.db.Outbox()+` SET failures = 5, attempts = 5,
 last_error = 'PRECONDITION_FAILED - message too large', quarantined_at = clock_timestamp() WHERE id = $1`, id)
				require.NoError(t, err)
			}
			rowPage := "/eo/outbox/rows/" + itoa(id)

			// The page.
			action, v := form(t, page(t, e.get(rowPage), http.StatusOK), verb+"-form")
			action, v = form(t, page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusOK), "confirm-form")
			again()
			page(t, e.call("POST", action, v, "Sec-Fetch-Site", "same-origin"), http.StatusConflict)
			require.EqualValues(t, 1, e.outboxRows("orders", "u1"), "the row stays")

			// The API.
			var shown rowJSON
			decode(t, e.get("/eo/api/v1/outbox/rows/"+itoa(id)), &shown)
			again()
			apiErr(t, e.call("POST", "/eo/api/v1/outbox/rows/"+itoa(id)+"/"+verb, map[string]any{"version": shown.Version}), http.StatusConflict, codeChanged)
			var now rowJSON
			decode(t, e.get("/eo/api/v1/outbox/rows/"+itoa(id)), &now)
			require.Equal(t, "quarantined", now.State)
			ok(t, e.call("POST", "/eo/api/v1/outbox/rows/"+itoa(id)+"/"+verb, map[string]any{"version": now.Version}))
		})
	}
}
