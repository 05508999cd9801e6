package inboxdb

// ParkedMessage is the message a key was parked with: kept with the park
// (in the same statement or transaction) in the table of parked messages,
// <inbox>_parked (migration inbox_001), so that an operator can find it and
// replay it. The Redis store keeps the same fields in the key's record
// (hash fields m_uuid, m_topic, m_payload, m_size, m_meta as JSON, and
// parked_at_ms).
type ParkedMessage struct {
	// UUID is the message's UUID.
	UUID string
	// Topic is the topic it was consumed from (Watermill's
	// message.SubscribeTopicFromCtx); "" when unknown.
	Topic string
	// Payload is the message's payload; nil when it was larger than the
	// middleware keeps (PayloadSize says how large): such a message cannot
	// be replayed.
	Payload []byte
	// PayloadSize is the payload's size in bytes, kept or not.
	PayloadSize int
	// Metadata is the message's metadata.
	Metadata map[string]string
}

// Kept reports whether the payload was kept (a replay needs it).
func (m ParkedMessage) Kept() bool { return m.Payload != nil || m.PayloadSize == 0 }
