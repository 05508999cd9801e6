package rabbitmq

import (
	"fmt"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// checkShortstrs checks the fields AMQP 0-9-1 encodes as short strings (at
// most 255 bytes): the routing key, the string properties and the header
// names, nested tables included. amqp091-go finds out only while writing the
// frame, and then closes the connection.
func checkShortstrs(topic string, p amqp091.Publishing) error {
	for _, f := range [...]struct{ name, value string }{
		{"the topic (routing key)", topic},
		{"content_type", p.ContentType}, {"content_encoding", p.ContentEncoding},
		{"correlation_id", p.CorrelationId}, {"reply_to", p.ReplyTo},
		{"expiration", p.Expiration}, {"message_id", p.MessageId},
		{"type", p.Type}, {"user_id", p.UserId}, {"app_id", p.AppId},
	} {
		if len(f.value) > 255 {
			return fmt.Errorf("%s is %d bytes, AMQP allows at most 255", f.name, len(f.value))
		}
	}
	return checkTableKeys(p.Headers)
}

func checkTableKeys(v any) error {
	switch t := v.(type) {
	case amqp091.Table:
		for k, e := range t {
			if len(k) > 255 {
				return fmt.Errorf("header name %.40q... is %d bytes, AMQP allows at most 255", k, len(k))
			}
			if err := checkTableKeys(e); err != nil {
				return err
			}
		}
	case []any:
		for _, e := range t {
			if err := checkTableKeys(e); err != nil {
				return err
			}
		}
	}
	return nil
}

// frameFits reports an error when pub's content header would not fit in one
// frame of frameMax bytes (the connection's negotiated frame_max; 0, unknown:
// no check): RabbitMQ closes the whole
// connection on such a frame (501 FRAME_ERROR), failing every call on it,
// again at each retry. A message with that much in its headers can never
// be sent.
func frameFits(frameMax int, topic string, pub amqp091.Publishing) error {
	if frameMax <= 0 {
		return nil
	}
	// Frame header (7) and end (1); class, weight, body size (12); the
	// property flags (2) and the properties.
	size := 7 + 1 + 12 + 2 + 1 + 1 + 8 // delivery mode, priority, timestamp
	for _, v := range []string{pub.ContentType, pub.ContentEncoding, pub.CorrelationId, pub.ReplyTo,
		pub.Expiration, pub.MessageId, pub.Type, pub.UserId, pub.AppId} {
		size += 1 + len(v)
	}
	size += tableSize(pub.Headers)
	if size > frameMax {
		return fmt.Errorf("its properties and headers take about %d bytes, more than the connection's frame size (%d)", size, frameMax)
	}
	return nil
}

// tableSize is the encoded size of an AMQP field table (an upper bound for
// the types amqp091-go encodes).
func tableSize(t amqp091.Table) int {
	n := 4
	for k, v := range t {
		n += 1 + len(k) + 1 + valueSize(v)
	}
	return n
}

func valueSize(v any) int {
	switch x := v.(type) {
	case string:
		return 4 + len(x)
	case []byte:
		return 4 + len(x)
	case amqp091.Table:
		return tableSize(x)
	case []any:
		n := 4
		for _, e := range x {
			n += 1 + valueSize(e)
		}
		return n
	case amqp091.Decimal:
		return 5
	default: // numbers, booleans, timestamps, nil
		return 8
	}
}
