package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// A consumer name that has no record in the inbox is most likely a typo
// (charge_order for charge-order): the commands that take a consumer say
// so, with the consumers that have records, instead of an empty result
// ("No parked keys.", exit status 0) that reads as "all is well". A
// consumer whose records were all purged reads as unknown too: there is
// nothing of it to show. The look-ups are inbox.Store's HasConsumer and
// Consumers, which the web console (package console) shares.

// Consumers listed in the message, and read at most.
const (
	consumersListed  = 20
	consumersScanned = 1000
)

// checkConsumer returns nil when consumer has a record or a parked message
// in db's inbox, else an error with exit status 3 that lists the consumers
// that have.
func checkConsumer(ctx context.Context, db sqlschema.DB, consumer string) error {
	s, err := inbox.NewStore(db)
	if err != nil {
		return err
	}
	known, err := s.HasConsumer(ctx, consumer)
	if err != nil {
		return opErr(ctx, db, "looking the consumer up", err)
	}
	if known {
		return nil
	}
	names, err := s.Consumers(ctx, consumersScanned+1)
	if err != nil {
		return opErr(ctx, db, "listing the consumers", err)
	}
	more := len(names) > consumersScanned // more consumers than were read
	if more {
		names = names[:consumersScanned]
	}
	which := "no consumer has records"
	if len(names) > 0 {
		which = "consumers with records: " + strings.Join(names[:min(len(names), consumersListed)], ", ")
		switch rest := len(names) - consumersListed; {
		case more:
			which += fmt.Sprintf(" and more than %d more", max(rest, 0))
		case rest > 0:
			which += fmt.Sprintf(" and %d more", rest)
		}
	}
	return notFoundErr("unknown consumer %q: no records in inbox table %s; %s", consumer, db.Inbox(), which)
}
