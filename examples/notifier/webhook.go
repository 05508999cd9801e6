package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/middleware"
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
// inbox in the same transaction as the status update.
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
	var rc Receipt
	if err := json.Unmarshal(body, &rc); err != nil || rc.NotificationID == "" || rc.Status == "" || len(rc.Status) > 32 {
		s.metrics.receipts.WithLabelValues("invalid").Inc()
		http.Error(w, `want JSON {"notification_id": "...", "status": "delivered"}`, http.StatusBadRequest)
		return
	}
	key, _ := middleware.KeyFromPayloadSHA256()(message.NewMessage("", body))

	result, err := s.applyReceipt(r.Context(), key, rc)
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

func (s *Service) applyReceipt(ctx context.Context, key string, rc Receipt) (string, error) {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return "", err
	}
	defer func() { _ = tx.Rollback() }()
	claim, err := s.store.ClaimTx(ctx, tx, receiptsConsumer, key)
	if err != nil {
		return "", err
	}
	if !claim.Claimed {
		return "duplicate", tx.Commit()
	}
	res, err := tx.ExecContext(ctx, `UPDATE `+s.logTable+` SET status = $2, updated_at = now() WHERE notification_id = $1`,
		rc.NotificationID, strings.ToLower(rc.Status))
	if err != nil {
		return "", err
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return "", errUnknownNotification
	}
	return "applied", tx.Commit()
}
