package main

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

// TestNotifierTwoInstances: two notifier processes on the same database and
// queues (each with its workers and its own relay) share the work, and each
// notification is still sent, logged and announced exactly once. On each
// database engine.
func TestNotifierTwoInstances(t *testing.T) {
	t.Parallel()
	forEachEngine(t, testNotifierTwoInstances)
}

func testNotifierTwoInstances(t *testing.T, engine string) {
	a := startNotifier(t, notifierOptions{engine: engine})
	b := startNotifier(t, notifierOptions{same: a})

	const total = 60
	var pubs []amqp.Publishing
	extra := 0
	for i := range total {
		r := SendRequest{NotificationID: fmt.Sprintf("n-%02d", i), Channel: "sms", To: fmt.Sprintf("+38050%07d", i), Text: "hello"}
		copies := 1
		if i%3 == 0 {
			copies = 2
			extra++
		}
		for range copies {
			pubs = append(pubs, request(fmt.Sprintf("msg-%02d", i), r))
		}
	}
	rand.Shuffle(len(pubs), func(i, j int) { pubs[i], pubs[j] = pubs[j], pubs[i] })
	a.publish(pubs...)

	a.waitFor(60*time.Second, "every notification sent and logged, every extra copy blocked, the outbox empty", func() (bool, string) {
		sms, _ := a.providerCalls()
		dups := a.metric(seriesDuplicates) + b.metric(seriesDuplicates)
		rows, pending := len(a.logRows()), a.pending()
		return len(sms) == total && rows == total && dups == float64(extra) && pending == 0,
			fmt.Sprintf("provider keys %d, log rows %d, duplicates %v of %d, pending %d", len(sms), rows, dups, extra, pending)
	})

	sms, _ := a.providerCalls()
	for i := range total {
		require.Equal(t, 1, sms[idemKey(fmt.Sprintf("msg-%02d", i))], "provider calls for msg-%02d", i)
	}
	claimsA, claimsB := a.metric(seriesProcessed), b.metric(seriesProcessed)
	require.Equal(t, float64(total), claimsA+claimsB, "each notification claimed and processed once across both instances")
	require.Positive(t, claimsA, "instance A took part")
	require.Positive(t, claimsB, "instance B took part")

	events := a.drain(a.sent)
	ids := map[string]int{}
	for _, d := range events {
		ids[fmt.Sprint(d.Headers["notification_id"])]++
	}
	require.Len(t, ids, total, "one notification.sent per notification")
	require.Len(t, events, total, "and no repeats")

	b.stop(30 * time.Second)
	a.stop(30 * time.Second)
}
