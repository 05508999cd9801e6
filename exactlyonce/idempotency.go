package exactlyonce

import (
	"crypto/sha256"
	"encoding/hex"
	"strconv"
	"strings"
)

// maxIdempotencyKey is the longest idempotency key, in bytes; a longer one
// is replaced by its SHA-256 (many providers limit the Idempotency-Key
// header to 255 characters).
const maxIdempotencyKey = 255

// idempotencyKey is Info.IdempotencyKey of (consumer, key). The encoding,
// for a consumer that contains no ':' and is not "sha256" (nearly all,
// whose keys read as they are):
//
//	<consumer>:<key>                  at most 255 bytes
//	sha256:<hex SHA-256 of consumer NUL key>   otherwise
//
// and for a consumer that contains ':' or is "sha256" (for which the
// first form would be ambiguous: consumer "a" with key "b:c" and consumer
// "a:b" with key "c" would share "a:b:c"):
//
//	:<len(consumer) in decimal>:<consumer>:<key>   at most 255 bytes
//	:sha256:<hex SHA-256 of that string>           otherwise
//
// It is injective (two different (consumer, key) pairs never share a key,
// save for a SHA-256 collision):
//
//   - A first-form key starts with its consumer, which is not empty (the
//     middleware refuses an empty consumer before any mode runs: ValidateKey)
//     and has no ':', so it never starts with ':'; a second-form key always
//     does. The two forms never meet.
//   - First form, short: the first ':' ends the consumer (it has none), the
//     rest is the key. Its consumer is never "sha256", so it never meets
//     the hashed first form, whose first field is "sha256". Hashed: the
//     input consumer NUL key is unambiguous (a consumer has no NUL).
//   - Second form, short: the digits up to the second ':' give the
//     consumer's length n (written by strconv.Itoa: no sign, no leading
//     zero), the n bytes after that ':' are the consumer, then one ':',
//     then the key. Its second field is digits, never "sha256", so it never
//     meets the hashed second form, whose input is the short second form,
//     itself injective.
func idempotencyKey(consumer, key string) string {
	if !strings.Contains(consumer, ":") && consumer != "sha256" {
		k := consumer + ":" + key
		if len(k) <= maxIdempotencyKey {
			return k
		}
		sum := sha256.Sum256([]byte(consumer + "\x00" + key))
		return "sha256:" + hex.EncodeToString(sum[:])
	}
	k := ":" + strconv.Itoa(len(consumer)) + ":" + consumer + ":" + key
	if len(k) <= maxIdempotencyKey {
		return k
	}
	sum := sha256.Sum256([]byte(k))
	return ":sha256:" + hex.EncodeToString(sum[:])
}
