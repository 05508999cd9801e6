package outbox

import (
	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxwrite"
)

// MaxOrderingKeyBytes is the longest ordering key the outbox accepts (the
// key is set with msgid.SetOrderingKey).
const MaxOrderingKeyBytes = outboxwrite.MaxOrderingKeyBytes
