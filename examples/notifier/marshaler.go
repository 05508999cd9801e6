package main

import (
	"encoding/json"
	"fmt"
	"time"

	wamqp "github.com/ThreeDotsLabs/watermill-amqp/v3/pkg/amqp"
	"github.com/ThreeDotsLabs/watermill/message"
	amqp "github.com/rabbitmq/amqp091-go"
)

// identityMarshaler reads messages from any producer:
//   - the message identity is the Watermill UUID header when a Watermill
//     producer sent it, else the AMQP message_id property (what PHP, Node or
//     Python clients set); with neither the UUID stays empty, and the
//     exactly-once middleware rejects the message (dead-lettered), never
//     processing it under a shared key;
//   - header values that are not strings (RabbitMQ's x-death after
//     dead-lettering, numbers, tables) become JSON text instead of failing
//     the whole delivery.
type identityMarshaler struct {
	wamqp.DefaultMarshaler
}

func (m identityMarshaler) Unmarshal(d amqp.Delivery) (*message.Message, error) {
	headers := make(amqp.Table, len(d.Headers))
	uuid := ""
	for k, v := range d.Headers {
		if k == wamqp.DefaultMessageUUIDHeaderKey {
			uuid = headerString(v)
			continue
		}
		headers[k] = headerString(v)
	}
	if uuid == "" {
		uuid = d.MessageId
	}
	msg := message.NewMessage(uuid, d.Body)
	for k, v := range headers {
		msg.Metadata.Set(k, v.(string))
	}
	return msg, nil
}

func headerString(v any) string {
	switch t := v.(type) {
	case string:
		return t
	case []byte:
		return string(t)
	case time.Time:
		return t.UTC().Format(time.RFC3339Nano)
	case nil:
		return ""
	}
	if b, err := json.Marshal(v); err == nil {
		return string(b)
	}
	return fmt.Sprint(v)
}
