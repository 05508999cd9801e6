package outbox

import (
	"context"
	"fmt"
)

// RunWith runs the relay (Run) together with others, such as the
// message.Router's Run whose handlers write the outbox and an HTTP
// server's, each in a goroutine of its own with a context derived from
// ctx, until ctx is done or one of them returns. The first to return, with
// an error or not, cancels that context, so that the others stop too: a
// router whose handlers all stopped (it then closes itself and its Run
// returns nil) stops the relay and the server with it, and the process
// can exit instead of relaying for a router that consumes nothing. RunWith
// returns once every one of them returned, with the first error one
// returned (nil when none did).
//
//	return relay.RunWith(ctx, router.Run)
//
// It is errgroup.WithContext with the relay in it, except that a return
// without an error stops the others too. Each function must return once
// its context is done, as Relay.Run and message.Router.Run do.
func (r *Relay) RunWith(ctx context.Context, others ...func(context.Context) error) error {
	for i, f := range others {
		if f == nil {
			return fmt.Errorf("outbox: Relay.RunWith: function %d of others is nil", i)
		}
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	results := make(chan error, len(others)+1)
	for _, f := range append([]func(context.Context) error{r.Run}, others...) {
		go func() { results <- f(ctx) }()
	}
	var first error
	for range len(others) + 1 {
		err := <-results
		cancel()
		if first == nil {
			first = err
		}
	}
	return first
}
