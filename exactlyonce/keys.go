package exactlyonce

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/exactlyonce/watermill-exactlyonce/internal/tenant"
)

// keyFromUUID keys on the Watermill message UUID: the default Config.Key. A
// message from a producer that is not Watermill has an empty UUID unless
// the subscriber's unmarshaler fills it (for RabbitMQ: rabbitmq.Marshaler
// takes the message_id property).
func keyFromUUID(msg *message.Message) (string, error) { return msg.UUID, nil }

// KeyFromMetadata keys on a metadata field, such as an idempotency key the
// producer sets ("Idempotency-Key" in HTTP terms). Use it as Config.Key.
func KeyFromMetadata(field string) func(msg *message.Message) (string, error) {
	return func(msg *message.Message) (string, error) { return msg.Metadata.Get(field), nil }
}

// KeyFromPayloadSHA256 keys on the hex SHA-256 of the payload: byte-equal
// payloads are duplicates, whatever their UUID. It suits webhooks, whose
// retries carry the same body. Unlike a short checksum it does not make
// distinct messages collide. Use it as Config.Key.
func KeyFromPayloadSHA256(msg *message.Message) (string, error) {
	sum := sha256.Sum256(msg.Payload)
	return hex.EncodeToString(sum[:]), nil
}

// KeyByTenant scopes keys by tenant: the key of a message is its tenant,
// taken from the metadata field tenantField, a colon, and the key inner
// derives (the message UUID when inner is nil). Use it as Config.Key when
// several tenants share a consumer and choose keys themselves (idempotency
// keys, their own message IDs): without it, a tenant that sends a key
// before another tenant does makes the other's message a duplicate, and it
// is acked unprocessed — on purpose (key poisoning) or by accident. The
// inbox holds one record per tenant and key, under the key
// tenant + ":" + key (inbox.TenantKey makes it for inbox.Store's Get,
// Forget and Release; Store.TenantStats and PurgeOptions.Tenant select a
// tenant). Config.MaxKeyLength counts all of it: the tenant and the colon
// too.
//
// The tenant must come from something the tenant cannot forge: set it where
// the message enters your system, after authentication, never from the
// tenant's own payload or headers. A message without a tenant, or whose
// tenant contains a colon, is refused (ErrInvalidKey: nacked after
// NackDelay; route it to a poison queue).
func KeyByTenant(tenantField string, inner func(msg *message.Message) (string, error)) func(msg *message.Message) (string, error) {
	if inner == nil {
		inner = keyFromUUID
	}
	return func(msg *message.Message) (string, error) {
		t := msg.Metadata.Get(tenantField)
		if err := tenant.Check(t); err != nil {
			return "", fmt.Errorf("metadata %q: %w", tenantField, err)
		}
		k, err := inner(msg)
		if err != nil {
			return "", err
		}
		if k == "" {
			return "", fmt.Errorf("tenant %q: the key within the tenant is empty", t)
		}
		return tenant.Key(t, k)
	}
}
