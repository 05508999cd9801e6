// Package tests holds the end-to-end tests of the library: a real Watermill
// router consuming from RabbitMQ, the exactly-once middleware, PostgreSQL,
// and the outbox relay publishing back to RabbitMQ. Every test runs once per
// driver (pgxpool and database/sql).
package tests

import (
	"testing"

	"go.uber.org/goleak"
)

// TestMain fails the run if a goroutine started by the tests (routers,
// subscribers, relays, pools, AMQP connections) is still running once every
// test and its cleanups finished. goleak retries for a while before it
// reports, so goroutines that are already on their way out are not flagged.
//
// The ignore list is empty on purpose: every background goroutine of pgxpool
// (health check), database/sql (connection opener), amqp091-go (reader,
// heartbeater) and watermill-amqp (reconnect loop) ends when its owner is
// closed, and testenv closes them all at cleanup. Add an entry here only for
// a goroutine that provably outlives a correct Close, with a comment saying
// whose it is and why.
func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}
