package rabbitmq

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	amqp091 "github.com/rabbitmq/amqp091-go"
)

// DefaultUUIDHeader is the header Watermill producers store the message UUID
// in (watermill-amqp's DefaultMessageUUIDHeaderKey).
const DefaultUUIDHeader = "_watermill_message_uuid"

// Metadata keys Unmarshal fills from AMQP properties, when the property is set
// and no header of the same name exists (a header wins).
const (
	MetadataContentType   = "amqp_content_type"   // content_type property
	MetadataCorrelationID = "amqp_correlation_id" // correlation_id property
	MetadataReplyTo       = "amqp_reply_to"       // reply_to property
	MetadataType          = "amqp_type"           // type property
	MetadataAppID         = "amqp_app_id"         // app_id property
)

// Marshaler converts between Watermill messages and AMQP 0-9-1 messages. It
// satisfies watermill-amqp v3's amqp.Marshaler; set it as
// amqp.Config.Marshaler. The zero value is ready to use.
type Marshaler struct {
	// NotPersistent publishes with the transient delivery mode (faster, lost
	// on a broker restart). Default false: persistent, like watermill-amqp's
	// DefaultMarshaler.
	NotPersistent bool

	// UUIDHeader is the header holding the Watermill message UUID.
	// Default "" means DefaultUUIDHeader ("_watermill_message_uuid").
	UUIDHeader string
}

func (m Marshaler) uuidHeader() string {
	if m.UUIDHeader != "" {
		return m.UUIDHeader
	}
	return DefaultUUIDHeader
}

// Marshal builds a publishing compatible with watermill-amqp's
// DefaultMarshaler: every metadata entry becomes a header as it is (amqp_*
// keys included; they are not turned back into properties), the UUID goes in
// the UUID header, and the delivery mode is persistent unless NotPersistent.
// It also sets the message_id property to the UUID, for consumers that are
// not Watermill.
func (m Marshaler) Marshal(msg *message.Message) (amqp091.Publishing, error) {
	if msg == nil {
		return amqp091.Publishing{}, errors.New("rabbitmq: Marshal called with a nil message; pass a *message.Message")
	}
	headers := make(amqp091.Table, len(msg.Metadata)+1)
	for k, v := range msg.Metadata {
		headers[k] = v
	}
	headers[m.uuidHeader()] = msg.UUID

	p := amqp091.Publishing{
		Headers:   headers,
		MessageId: msg.UUID,
		Body:      msg.Payload,
	}
	if !m.NotPersistent {
		p.DeliveryMode = amqp091.Persistent
	}
	return p, nil
}

// Unmarshal builds a Watermill message from a delivery. It never fails.
//
// The UUID is the UUID header when it is a non-empty string (or byte array),
// else the message_id property, else empty; an empty UUID is left for the
// exactly-once middleware to reject. Every other header but Publisher's
// PublishingHeader (its own bookkeeping) becomes metadata,
// converted to a string: strings as they are, byte arrays as text, numbers
// and booleans in decimal/true/false, timestamps as RFC 3339 in UTC, tables
// and arrays (such as x-death) as compact JSON with sorted keys. The
// content_type, correlation_id, reply_to, type and app_id properties are
// copied under the Metadata* keys. The payload is the body.
func (m Marshaler) Unmarshal(d amqp091.Delivery) (*message.Message, error) {
	uuidKey := m.uuidHeader()
	uuid := ""
	if v, ok := d.Headers[uuidKey]; ok {
		switch s := v.(type) {
		case string:
			uuid = s
		case []byte:
			uuid = string(s)
		}
	}
	if uuid == "" {
		uuid = d.MessageId
	}

	msg := message.NewMessage(uuid, d.Body)
	for k, v := range d.Headers {
		if k == uuidKey || k == PublishingHeader {
			continue
		}
		msg.Metadata[k] = headerString(v)
	}
	for _, p := range [...]struct{ key, value string }{
		{MetadataContentType, d.ContentType},
		{MetadataCorrelationID, d.CorrelationId},
		{MetadataReplyTo, d.ReplyTo},
		{MetadataType, d.Type},
		{MetadataAppID, d.AppId},
	} {
		if _, inHeaders := d.Headers[p.key]; p.value != "" && !inHeaders {
			msg.Metadata[p.key] = p.value
		}
	}
	return msg, nil
}

// headerString converts an AMQP header value to the string Unmarshal puts
// in metadata. It accepts any value and never fails.
func headerString(v any) string {
	switch t := v.(type) {
	case nil:
		return ""
	case string:
		return t
	case []byte:
		return string(t)
	case bool:
		return strconv.FormatBool(t)
	case int:
		return strconv.FormatInt(int64(t), 10)
	case int8:
		return strconv.FormatInt(int64(t), 10)
	case int16:
		return strconv.FormatInt(int64(t), 10)
	case int32:
		return strconv.FormatInt(int64(t), 10)
	case int64:
		return strconv.FormatInt(t, 10)
	case uint:
		return strconv.FormatUint(uint64(t), 10)
	case uint8:
		return strconv.FormatUint(uint64(t), 10)
	case uint16:
		return strconv.FormatUint(uint64(t), 10)
	case uint32:
		return strconv.FormatUint(uint64(t), 10)
	case uint64:
		return strconv.FormatUint(t, 10)
	case float32:
		return strconv.FormatFloat(float64(t), 'g', -1, 32)
	case float64:
		return strconv.FormatFloat(t, 'g', -1, 64)
	case time.Time:
		return t.UTC().Format(time.RFC3339Nano)
	case amqp091.Decimal:
		return decimalString(t)
	case amqp091.Table, map[string]any, []any:
		b, err := json.Marshal(jsonValue(t))
		if err != nil {
			return fmt.Sprint(v)
		}
		return string(b)
	default:
		return fmt.Sprint(v)
	}
}

// jsonValue makes a header value encodable by encoding/json with the same
// text headerString gives scalars: byte arrays as text (not base64),
// timestamps as RFC 3339 UTC strings, decimals as numbers, and NaN or
// infinite floats (which JSON cannot hold) as strings.
func jsonValue(v any) any {
	switch t := v.(type) {
	case amqp091.Table:
		return jsonValue(map[string]any(t))
	case map[string]any:
		out := make(map[string]any, len(t))
		for k, e := range t {
			out[k] = jsonValue(e)
		}
		return out
	case []any:
		out := make([]any, len(t))
		for i, e := range t {
			out[i] = jsonValue(e)
		}
		return out
	case []byte, time.Time:
		return headerString(t)
	case amqp091.Decimal:
		return json.Number(decimalString(t))
	case float32:
		if math.IsNaN(float64(t)) || math.IsInf(float64(t), 0) {
			return headerString(t)
		}
	case float64:
		if math.IsNaN(t) || math.IsInf(t, 0) {
			return headerString(t)
		}
	}
	return v
}

// decimalString renders an AMQP decimal (Value × 10^-Scale), e.g. "-12.34".
func decimalString(d amqp091.Decimal) string {
	v := int64(d.Value)
	sign := ""
	if v < 0 {
		sign, v = "-", -v
	}
	digits := strconv.FormatInt(v, 10)
	scale := int(d.Scale)
	if scale == 0 {
		return sign + digits
	}
	if len(digits) <= scale {
		digits = strings.Repeat("0", scale-len(digits)+1) + digits
	}
	return sign + digits[:len(digits)-scale] + "." + digits[len(digits)-scale:]
}
