package outbox

import "errors"

// marked reports whether a publish error is marked as the message's own:
// err, or an error it wraps, has a method Permanent() bool that returns
// true (exactlyonce.Permanent makes such errors; rabbitmq.Publisher returns
// them). It is RelayConfig.IsPermanent's default.
func marked(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}
