package main

import (
	amqp "github.com/rabbitmq/amqp091-go"
)

// purgeQueues empties the demo's queues so that every run starts clean.
// Errors are ignored: a queue that does not exist yet has nothing to purge.
func purgeQueues(url string, queues ...string) {
	conn, err := amqp.Dial(url)
	if err != nil {
		return
	}
	defer conn.Close()
	for _, q := range queues {
		ch, err := conn.Channel()
		if err != nil {
			return
		}
		_, _ = ch.QueuePurge(q, false)
		_ = ch.Close()
	}
}
