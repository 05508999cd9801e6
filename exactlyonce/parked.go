package exactlyonce

import (
	"strings"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
)

// parkedMessage is what a park of the delivery keeps
// (Config.MaxParkedPayload): its message's UUID, the topic it was consumed
// from, its payload (left out when over the limit) and metadata. It refers
// to the message's payload and metadata, not copies (a handler that changes
// them in place changes what a later park keeps); the store encodes them
// only when it parks.
func (m *Guard) parkedMessage(d *delivery) *inboxdb.ParkedMessage {
	msg := d.msg
	pm := &inboxdb.ParkedMessage{
		UUID:        msg.UUID,
		Topic:       message.SubscribeTopicFromCtx(d.ctx),
		PayloadSize: len(msg.Payload),
		Metadata:    msg.Metadata,
	}
	if len(msg.Payload) <= m.cfg.MaxParkedPayload {
		pm.Payload = msg.Payload
	}
	return pm
}

// parkedCommands are the exactlyonce commands that show and replay the
// message parked for (consumer, key), for the store in use: the Redis
// store's take --redis-url.
func (m *Guard) parkedCommands(consumer, key string) (show, replay string) {
	store := ""
	if m.cfg.storeOnly() {
		store = "--redis-url <redis-url> "
	}
	args := store + shellQuote(consumer) + " " + shellQuote(key)
	if strings.HasPrefix(consumer, "-") || strings.HasPrefix(key, "-") {
		args = store + "-- " + shellQuote(consumer) + " " + shellQuote(key) // not flags
	}
	return "exactlyonce parked show " + args, "exactlyonce parked replay " + args
}

// shellQuote quotes s for a POSIX shell when it needs it.
func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/@%+=,") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}
