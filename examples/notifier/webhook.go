package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
)

// receiptsConsumer is the inbox consumer name of the receipts webhook.
const receiptsConsumer = "receipts-webhook"

// Receipt is a provider's delivery receipt.
type Receipt struct {
	NotificationID string `json:"notification_id"`
	Status         string `json:"status"`
}

// handleReceipt applies a delivery receipt once: providers retry webhooks
// with the same body, so the key is the SHA-256 of the body, claimed in the
// inbox in the same transaction as the status update. The claim is the
// exactly-once middleware's (s.receipts), called on a message made of the
// body: an HTTP handler gets the same guarantee as a queue handler.
func (s *Service) handleReceipt(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		http.Error(w, "POST only", http.StatusMethodNotAllowed)
		return
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, 64<<10))
	if err != nil {
		http.Error(w, "cannot read body", http.StatusBadRequest)
		return
	}
	rc, err := parseReceipt(body)
	if err != nil {
		s.metrics.receipts.WithLabelValues("invalid").Inc()
		http.Error(w, err.Error()+`: want JSON {"notification_id": "...", "status": "delivered"}`, http.StatusBadRequest)
		return
	}
	result, err := s.applyReceipt(r.Context(), body, rc)
	switch {
	case errors.Is(err, errUnknownNotification):
		// Not ours yet (the receipt can overtake our commit): the provider
		// retries, and nothing was recorded, so the retry is applied.
		s.metrics.receipts.WithLabelValues("unknown_notification").Inc()
		http.Error(w, err.Error(), http.StatusNotFound)
		return
	case err != nil:
		s.logger.Error("receipt failed", "err", err)
		http.Error(w, "temporarily unavailable", http.StatusServiceUnavailable)
		return
	}
	s.metrics.receipts.WithLabelValues(result).Inc()
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]string{"result": result})
}

var errUnknownNotification = errors.New("unknown notification_id")

// errInvalidReceipt marks a receipt body that can never be applied.
var errInvalidReceipt = errors.New("invalid receipt")

// parseReceipt reads a receipt body: notification_id and status are
// required, status at most 32 bytes, and neither may hold NUL (PostgreSQL
// text cannot) or invalid UTF-8.
func parseReceipt(body []byte) (Receipt, error) {
	var rc Receipt
	if !utf8.Valid(body) {
		return rc, fmt.Errorf("%w: body is not UTF-8", errInvalidReceipt)
	}
	if err := json.Unmarshal(body, &rc); err != nil {
		return rc, fmt.Errorf("%w: %w", errInvalidReceipt, err)
	}
	switch {
	case strings.TrimSpace(rc.NotificationID) == "" || strings.TrimSpace(rc.Status) == "":
		return rc, fmt.Errorf("%w: notification_id and status are required", errInvalidReceipt)
	case len(rc.Status) > 32 || len(rc.NotificationID) > 200:
		return rc, fmt.Errorf("%w: status is limited to 32 bytes, notification_id to 200", errInvalidReceipt)
	case strings.ContainsRune(rc.NotificationID+rc.Status, 0):
		return rc, fmt.Errorf("%w: a field contains a NUL character", errInvalidReceipt)
	}
	return rc, nil
}

// applyReceipt runs the status update under the receipts middleware: a body
// already applied is a duplicate and the update does not run; an error rolls
// everything back, the claim included, so the provider's retry is applied.
func (s *Service) applyReceipt(ctx context.Context, body []byte, rc Receipt) (string, error) {
	applied := false
	update := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		tx, err := handlerTx(ctx, s.db.Dialect)
		if err != nil {
			return nil, err
		}
		res, err := tx.ExecContext(ctx, s.st["SetStatus"], strings.ToLower(rc.Status), rc.NotificationID)
		if err != nil {
			return nil, err
		}
		n, err := res.RowsAffected()
		if err != nil {
			return nil, err
		}
		if n == 0 {
			// No such row, or (MySQL counts rows changed) one that
			// already held these values.
			var one int
			found, err := queryRow(ctx, tx, s.st["LockLogRow"], []any{rc.NotificationID}, &one)
			if err != nil {
				return nil, err
			}
			if !found {
				return nil, errUnknownNotification
			}
		}
		applied = true
		return nil, nil
	}
	msg := message.NewMessage(watermill.NewUUID(), body) // keyed on the body, not the UUID
	msg.SetContext(ctx)
	if _, err := s.receipts.Middleware(update)(msg); err != nil {
		return "", err
	}
	if !applied {
		return "duplicate", nil
	}
	return "applied", nil
}
