package console

import (
	"context"
	"errors"
	"net/http"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/outbox"
)

// The actions on one key or one outbox row, as the API and the pages run
// them. Each carries what the operator was shown (an Expect: the version
// of the parked message, record or row on the page that was confirmed, and
// for a parked message its UUID); the store checks it under the key's or
// the row's lock in the step that acts, and refuses a target that changed
// (ErrChanged: 409 "changed", nothing done). The API takes the same
// precondition, optional for scripts. Every action is logged (audit),
// with the version it expected.

// expectOf reads a precondition: the version shown, and the message's
// UUID and the key's status when given.
func expectOf(version, uuid, status string) (inbox.Expect, error) {
	for _, f := range []struct{ name, v string }{{"version", version}, {"uuid", uuid}, {"status", status}} {
		if err := checkText(f.name, f.v); err != nil {
			return inbox.Expect{}, err
		}
	}
	return inbox.Expect{Version: version, MessageUUID: uuid, Status: status}, nil
}

// expectAttrs are the log attributes of a precondition.
func expectAttrs(e inbox.Expect) []any {
	return []any{"expected_version", e.Version, "expected_uuid", e.MessageUUID, "expected_status", e.Status}
}

// replayOne replays the parked message of (consumer, key) if it is still
// what e says, and logs it.
func (h *handler) replayOne(ctx context.Context, r *http.Request, store, consumer, key, topic string, e inbox.Expect) (inbox.ParkedMessage, error) {
	m, err := h.parked(store).ReplayParked(ctx, consumer, key, inbox.ReplayOptions{Topic: topic, Expect: e})
	h.audit(r, "parked.replay", err, append([]any{"store", store, "consumer", consumer, "key", key, "topic", m.Topic,
		"uuid", m.UUID, "count", b2i(err == nil)}, expectAttrs(e)...)...)
	if err != nil {
		return inbox.ParkedMessage{}, h.notFoundOrUnknown(ctx, store, consumer, err)
	}
	return m, nil
}

// discardOne discards the parked message of (consumer, key) if it is
// still what e says, and logs it.
func (h *handler) discardOne(ctx context.Context, r *http.Request, store, consumer, key string, forget bool, e inbox.Expect) error {
	err := h.parked(store).DiscardParked(ctx, consumer, key, inbox.DiscardOptions{Forget: forget, Expect: e})
	h.audit(r, "parked.discard", err, append([]any{"store", store, "consumer", consumer, "key", key, "forget", forget,
		"count", b2i(err == nil)}, expectAttrs(e)...)...)
	if err != nil {
		return h.notFoundOrUnknown(ctx, store, consumer, err)
	}
	return nil
}

// forgetOne forgets (consumer, key) if its record is still what e says,
// and logs it. A key without a record is not found.
func (h *handler) forgetOne(ctx context.Context, r *http.Request, store, consumer, key string, e inbox.Expect) error {
	found, err := h.parked(store).Forget(ctx, consumer, key, e)
	h.audit(r, "inbox.forget", err, append([]any{"store", store, "consumer", consumer, "key", key, "count", b2i(found)},
		expectAttrs(e)...)...)
	if err == nil && !found {
		err = notFound("consumer %q, key %q has no record (forgotten or purged meanwhile?)", consumer, key)
	}
	if err != nil {
		var ae *apiError
		if errors.As(err, &ae) || errors.Is(err, inbox.ErrNotFound) {
			if cerr := h.unknownConsumer(ctx, store, consumer); cerr != nil {
				return cerr
			}
		}
		return err
	}
	return nil
}

// rowOne requeues or discards outbox row id if it is still what e says,
// and logs it.
func (h *handler) rowOne(ctx context.Context, r *http.Request, verb string, id int64, e outbox.Expect) error {
	err := h.rows.Act(ctx, verb, id, e)
	h.audit(r, "outbox."+verb, err, "id", id, "count", b2i(err == nil), "expected_version", e.Version)
	return err
}
