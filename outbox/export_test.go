package outbox

import "time"

// ChannelName exposes channelName to the tests of package outbox_test.
var ChannelName = channelName

// SetListenPing shortens the LISTEN connection's ping interval and timeout
// for a test, and returns a function that restores them.
func SetListenPing(every, timeout time.Duration) (restore func()) {
	oldEvery, oldTimeout := listenPing, listenPingTimeout
	listenPing, listenPingTimeout = every, timeout
	return func() { listenPing, listenPingTimeout = oldEvery, oldTimeout }
}

// SelectSQL is the statement that locks a relay's batch ($1 batch size, $2
// the most retried rows, $3 the paused topics).
func SelectSQL(r *Relay) string { return r.selectSQL }
