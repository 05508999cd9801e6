package main

import (
	"fmt"

	amqp "github.com/rabbitmq/amqp091-go"
)

// purgeQueues empties the quickstart's queues (declared before), so that
// every run starts clean.
func purgeQueues(url string, queues ...string) error {
	conn, err := amqp.Dial(url)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	for _, q := range queues {
		if _, err := ch.QueuePurge(q, false); err != nil {
			return fmt.Errorf("purging queue %s: %w", q, err)
		}
	}
	return ch.Close()
}
