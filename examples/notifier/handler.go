package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
)

// ErrInvalidRequest marks a send request that can never be processed; such
// messages go to the dead-letter queue with the reason (validate marks them
// exactlyonce.Permanent, which the dead-letter filter, exactlyonce.IsPermanent,
// recognises).
var ErrInvalidRequest = errors.New("invalid send request")

// SendRequest is the body of a message on the send queue.
type SendRequest struct {
	NotificationID string `json:"notification_id"`
	Channel        string `json:"channel"`
	To             string `json:"to"`
	Text           string `json:"text"`
}

// SentEvent is published to the sent queue once per notification.
type SentEvent struct {
	NotificationID string    `json:"notification_id"`
	Channel        string    `json:"channel"`
	To             string    `json:"to"`
	Attempt        int       `json:"attempt"`
	IdempotencyKey string    `json:"idempotency_key"`
	SentAt         time.Time `json:"sent_at"`
}

func parseRequest(payload []byte) (SendRequest, error) {
	var r SendRequest
	if !utf8.Valid(payload) {
		return r, fmt.Errorf("%w: body is not UTF-8 text", ErrInvalidRequest)
	}
	if err := json.Unmarshal(payload, &r); err != nil {
		return r, fmt.Errorf("%w: body is not the expected JSON object: %w", ErrInvalidRequest, err)
	}
	r.Channel = strings.ToLower(strings.TrimSpace(r.Channel))
	switch {
	case strings.TrimSpace(r.NotificationID) == "":
		return r, fmt.Errorf("%w: notification_id is missing", ErrInvalidRequest)
	case len(r.NotificationID) > 200:
		return r, fmt.Errorf("%w: notification_id is longer than 200 bytes", ErrInvalidRequest)
	case r.Channel != "sms" && r.Channel != "email":
		return r, fmt.Errorf("%w: channel %q is not sms or email", ErrInvalidRequest, r.Channel)
	case strings.TrimSpace(r.To) == "":
		return r, fmt.Errorf("%w: to is missing", ErrInvalidRequest)
	case r.Text == "":
		return r, fmt.Errorf("%w: text is missing", ErrInvalidRequest)
	case strings.ContainsRune(r.NotificationID+r.To+r.Text, 0):
		// PostgreSQL text cannot store NUL: such a request would fail
		// after the provider call, on every attempt.
		return r, fmt.Errorf("%w: a field contains a NUL character", ErrInvalidRequest)
	}
	return r, nil
}

// validate rejects, before any claim, what can never succeed: no identity
// (exactlyonce.ErrInvalidKey) and malformed requests (ErrInvalidRequest,
// marked Permanent). The dead-letter middleware outside it moves them aside
// with the reason; nothing is recorded in the inbox for them.
func validate(h message.HandlerFunc) message.HandlerFunc {
	return func(msg *message.Message) ([]*message.Message, error) {
		if msg.UUID == "" {
			return nil, fmt.Errorf("%w: the message has neither the Watermill UUID header nor the AMQP message_id property", exactlyonce.ErrInvalidKey)
		}
		if _, err := parseRequest(msg.Payload); err != nil {
			return nil, exactlyonce.Permanent(err)
		}
		return h(msg)
	}
}

// send is the lease-mode handler: call the provider with the attempt's
// idempotency key, then record the notification and emit the event in the
// completion transaction.
func (s *Service) send(msg *message.Message) ([]*message.Message, error) {
	ctx := msg.Context()
	req, err := parseRequest(msg.Payload)
	if err != nil {
		return nil, err // validate() already rejected these
	}
	info, err := exactlyonce.InfoFromContext(ctx)
	if err == nil && info.Attempt == 0 {
		err = errors.New("transactional mode")
	}
	if err != nil {
		return nil, fmt.Errorf("notifier: send must run under the lease-mode middleware: %w", err)
	}
	// A failed attempt is retried with the same idempotency key, up to
	// MaxAttempts; then the notification is parked for an operator.
	giveUp := func(err error) error {
		if info.Attempt >= s.cfg.MaxAttempts {
			return exactlyonce.Permanent(fmt.Errorf("giving up after %d attempts: %w", info.Attempt, err))
		}
		return err
	}
	provider := s.providers[req.Channel]
	if err := provider.Send(ctx, info.IdempotencyKey, req.To, req.Text); err != nil {
		if errors.Is(err, errRejected) {
			return nil, exactlyonce.Permanent(err) // parked for an operator, acked
		}
		return nil, giveUp(err)
	}

	tx, err := handlerTx(ctx, s.db.Dialect)
	if err != nil {
		return nil, giveUp(err)
	}
	if _, err := tx.ExecContext(ctx, s.st["RecordSent"],
		req.NotificationID, req.Channel, req.To, info.Attempt, msg.UUID); err != nil {
		return nil, giveUp(err)
	}
	event, err := json.Marshal(SentEvent{
		NotificationID: req.NotificationID, Channel: req.Channel, To: req.To,
		Attempt: info.Attempt, IdempotencyKey: info.IdempotencyKey, SentAt: time.Now().UTC(),
	})
	if err != nil {
		return nil, err
	}
	out := message.NewMessage(watermill.NewUUID(), event)
	out.Metadata.Set("notification_id", req.NotificationID)
	return []*message.Message{out}, nil
}
