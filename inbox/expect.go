package inbox

import (
	"github.com/exactlyonce/watermill-exactlyonce/internal/parked"
)

// ErrChanged is returned (wrapped) by an action given an Expect that no
// longer holds: the key's record or its parked message is not what the
// operator was shown (another operator acted, the key was replayed and
// parked again, a delivery processed it). Nothing was done; the error says
// what the key is now. Look again, and act on what you see then.
var ErrChanged = parked.ErrChanged

// Expect is what an operator (a page, a script) was shown of a key before
// acting on it: an action given one acts only while the key still is so,
// checked under the key's locks in the transaction (or, for the Redis
// store, the script) that acts, and otherwise returns an error wrapping
// ErrChanged and changes nothing. Fields left empty are not checked; the
// zero Expect checks nothing (a script that acts whatever the state).
//
// A console or tool that shows a key and then confirms an action on it
// passes the Version it showed: an action never lands on a message or a
// state the operator did not see.
type Expect struct {
	// Version is the Version of what was shown: the parked message's
	// (ParkedMessage.Version) for ReplayParked and DiscardParked, the
	// record's (Record.Version) for Forget and Release.
	Version string
	// MessageUUID is the UUID of the key's parked message that was shown
	// (ReplayParked, DiscardParked, and Forget, which deletes it with the
	// record).
	MessageUUID string
	// Status is the key's record status that was shown ("parked", say).
	Status string
}

// internal is e for the stores' shared checks (redisstore converts it the
// same way: the two types have the same fields).
func (e Expect) internal() parked.Expect { return parked.Expect(e) }
