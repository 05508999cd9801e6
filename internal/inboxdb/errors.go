package inbox

import "errors"

var (
	// ErrEmptyKey means a message has no key to deduplicate on. It is never
	// replaced by a shared key: that would make distinct messages duplicates
	// of each other.
	ErrEmptyKey = errors.New("empty message key")

	// ErrKeyTooLong means a key is longer than Config.MaxKeyLength.
	ErrKeyTooLong = errors.New("message key too long")

	// ErrInvalidKey means a key is not valid UTF-8 or contains a NUL byte,
	// which PostgreSQL text cannot store.
	ErrInvalidKey = errors.New("invalid message key")

	// ErrEmptyConsumer means no consumer name was given.
	ErrEmptyConsumer = errors.New("empty consumer name")

	// ErrNotFound is returned by Lookup when the key has no record.
	ErrNotFound = errors.New("inbox: no record for this consumer and key")

	// ErrNotDone is returned (wrapped) by ClaimTx when the key has a record
	// in a status other than done, written by lease mode. Transactional and
	// lease mode must not share a consumer name.
	ErrNotDone = errors.New("inbox: key has a record that is not done")
)
