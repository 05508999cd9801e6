package outboxnotify_test

import (
	"testing"
	"time"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxnotify"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// A relay's subscription receives one pending wake per Committed of its
// table (any number of them), none of another table's, and none once
// cancelled.
func TestSubscribeCommitted(t *testing.T) {
	db := sqlschema.DB{Dialect: sqlschema.MySQL, Schema: "s_" + t.Name()}
	other := db
	other.OutboxTable = "other"
	wake, cancel := outboxnotify.Subscribe(db)
	wake2, cancel2 := outboxnotify.Subscribe(db)
	defer cancel2()

	outboxnotify.Committed(other)
	requireNone(t, wake)
	outboxnotify.Committed(db)
	outboxnotify.Committed(db) // does not block, does not accumulate
	requireOne(t, wake)
	requireNone(t, wake)
	requireOne(t, wake2)

	cancel()
	cancel() // idempotent
	outboxnotify.Committed(db)
	requireNone(t, wake)
	requireOne(t, wake2)
}

func requireOne(t *testing.T, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(time.Second):
		t.Fatal("no wake")
	}
}

func requireNone(t *testing.T, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
		t.Fatal("an unexpected wake")
	case <-time.After(20 * time.Millisecond):
	}
}
