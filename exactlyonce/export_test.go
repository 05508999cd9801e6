package exactlyonce

// IdempotencyKey is Info.IdempotencyKey of a record this version created
// (or of a delivery with no record that outlives its attempt).
func IdempotencyKey(consumer, key string) string { return idempotencyKey(consumer, key, false) }
