package inboxdb

import (
	"errors"
	"fmt"
)

// Errors carry no package prefix: the public package that returns them
// wraps them in a message that has one.
var (
	// ErrInvalidKey means a message cannot be deduplicated: its key or
	// consumer name is empty, too long, not valid UTF-8 or contains a NUL
	// byte. Every key error below wraps it.
	ErrInvalidKey = errors.New("invalid message key")

	// ErrEmptyKey means a message has no key to deduplicate on. It is never
	// replaced by a shared key: that would make distinct messages duplicates
	// of each other.
	ErrEmptyKey = fmt.Errorf("%w: empty", ErrInvalidKey)

	// ErrKeyTooLong means a key is longer than Config.MaxKeyLength.
	ErrKeyTooLong = fmt.Errorf("%w: too long", ErrInvalidKey)

	// ErrEmptyConsumer means no consumer name was given.
	ErrEmptyConsumer = fmt.Errorf("%w: empty consumer name", ErrInvalidKey)

	// ErrNotFound is returned by Lookup when the key has no record.
	ErrNotFound = errors.New("no record for this consumer and key")

	// ErrNotDone is returned (wrapped) by ClaimTx when the key has a record
	// in a status other than done, written by lease mode. Transactional and
	// lease mode must not share a consumer name.
	ErrNotDone = errors.New("the key has a lease-mode record that is not done (transactional and lease mode must not share a consumer name)")
)
