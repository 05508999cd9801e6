package msgid_test

import (
	"context"
	"sync/atomic"
	"testing"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/msgid"
)

func TestNamedIsRFC9562UUIDv5(t *testing.T) {
	// RFC 9562 appendix A.4: "www.example.com" in the DNS namespace.
	id, err := msgid.Named(uuid.NameSpaceDNS.String(), "www.example.com")
	require.NoError(t, err)
	require.Equal(t, "2ed6657d-e927-568b-95e1-2665a8aea6a2", id)

	a, err := msgid.Named("reminders", "reminder:appt-7:24h")
	require.NoError(t, err)
	again, err := msgid.Named("reminders", "reminder:appt-7:24h")
	require.NoError(t, err)
	require.Equal(t, a, again, "the same inputs give the same UUID")
	require.Equal(t, uuid.Version(5), uuid.MustParse(a).Version())
	require.Equal(t, uuid.NewSHA1(uuid.NewSHA1(uuid.NameSpaceURL, []byte("urn:exactlyonce:reminders")), []byte("reminder:appt-7:24h")).String(), a,
		"the documented derivation, reproducible elsewhere")

	resend, err := msgid.Named("reminders", "reminder:appt-7:24h:resend-1")
	require.NoError(t, err)
	require.NotEqual(t, a, resend, "a new logical send has a new name, so a new UUID")
	other, err := msgid.Named("invoices", "reminder:appt-7:24h")
	require.NoError(t, err)
	require.NotEqual(t, a, other, "namespaces keep equal names apart")

	_, err = msgid.Named("", "x")
	require.ErrorContains(t, err, "empty namespace")
	_, err = msgid.Named("ns", "")
	require.ErrorContains(t, err, "empty name")
}

func TestNewIsTimeOrderedUUIDv7(t *testing.T) {
	prev := ""
	for range 10000 {
		id, err := msgid.New()
		require.NoError(t, err)
		require.Equal(t, uuid.Version(7), uuid.MustParse(id).Version())
		require.Greater(t, id, prev, "strictly increasing within a process")
		prev = id
	}
}

// A producer whose publish is retried (an HTTP request retried by its
// client after a timeout: the first attempt published, the client never
// heard) sends the message twice, and the consumer gets both; with the UUID
// from Named its inbox drops the repeat, with a random one it acts twice.
// The resend on purpose, under a new name, is processed.
func TestNamedRetriedPublishIsProcessedOnce(t *testing.T) {
	d := testenv.Drivers(t)[0]
	tables := testenv.WithConn(testenv.Schema(t), d.DB)
	var runs atomic.Int64
	eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, Consumer: "sms", Logger: testenv.Logger(t)})
	require.NoError(t, err)
	h := eo.Middleware(func(*message.Message) ([]*message.Message, error) { runs.Add(1); return nil, nil })

	// The producer's request handler: derives the ID from the request.
	publish := func(appointment, sendName string) *message.Message {
		id, err := msgid.Named("reminders", "reminder:"+appointment+":"+sendName)
		require.NoError(t, err)
		return message.NewMessage(id, []byte(`{"appointment":"`+appointment+`"}`))
	}
	for _, m := range []*message.Message{
		publish("appt-7", "24h"),
		publish("appt-7", "24h"), // the client's retry
		publish("appt-7", "24h-resend-1"),
	} {
		m.SetContext(context.Background())
		_, err := h(m)
		require.NoError(t, err)
	}
	require.Equal(t, int64(2), runs.Load(), "the retry was dropped, the deliberate resend processed")

	// The same with random IDs: the retry is processed again.
	for range 2 {
		id, err := msgid.New()
		require.NoError(t, err)
		_, err = h(message.NewMessage(id, []byte(`{"appointment":"appt-8"}`)))
		require.NoError(t, err)
	}
	require.Equal(t, int64(4), runs.Load(), "random IDs: the inbox cannot tell a retry from a new message")
}
