package exactlyonce

// IdempotencyKey is Info.IdempotencyKey of (consumer, key).
func IdempotencyKey(consumer, key string) string { return idempotencyKey(consumer, key) }
