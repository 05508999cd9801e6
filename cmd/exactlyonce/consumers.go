package main

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// A consumer name that has no record in the inbox is most likely a typo
// (charge_order for charge-order): the commands that take a consumer say
// so, with the consumers that have records, instead of an empty result
// ("No parked keys.", exit status 0) that reads as "all is well". A
// consumer whose records were all purged reads as unknown too: there is
// nothing of it to show.

// Consumers listed in the message, and read at most per table.
const (
	consumersListed  = 20
	consumersScanned = 1000
)

// parkedTable is the inbox's table of parked messages, quoted.
func parkedTable(db sqlschema.DB) string {
	return pgx.Identifier{db.Schema, db.InboxTable + "_parked"}.Sanitize()
}

// knownConsumerSQL tells whether a consumer has a record or a parked
// message: two primary-key look-ups (consumer is the keys' first column).
func knownConsumerSQL(db sqlschema.DB) string {
	return `SELECT EXISTS (SELECT 1 FROM ` + db.Inbox() + ` WHERE consumer = $1)
    OR EXISTS (SELECT 1 FROM ` + parkedTable(db) + ` WHERE consumer = $1)`
}

// consumersSQL lists the distinct consumers of table in order, at most $1,
// by a loose index scan of its primary key (consumer, message_key[,
// partition_at]): one index descent per consumer, whatever the number of
// records, where SELECT DISTINCT would read them all.
func consumersSQL(table string) string {
	return `WITH RECURSIVE c AS (
    (SELECT consumer FROM ` + table + ` ORDER BY consumer LIMIT 1)
  UNION ALL
    SELECT (SELECT t.consumer FROM ` + table + ` t WHERE t.consumer > c.consumer ORDER BY t.consumer LIMIT 1)
    FROM c WHERE c.consumer IS NOT NULL
)
SELECT consumer FROM c WHERE consumer IS NOT NULL LIMIT $1`
}

// checkConsumer returns nil when consumer has a record or a parked message
// in db's inbox, else an error with exit status 3 that lists the consumers
// that have.
func checkConsumer(ctx context.Context, db sqlschema.DB, consumer string) error {
	var known bool
	if err := seam.QueryRow(ctx, db.Conn, knownConsumerSQL(db), []any{consumer}, &known); err != nil {
		return opErr(ctx, db, "looking the consumer up", err)
	}
	if known {
		return nil
	}
	set := map[string]bool{}
	more := false // a table has more consumers than were read
	for _, table := range []string{db.Inbox(), parkedTable(db)} {
		rows, err := db.Conn.QueryContext(ctx, consumersSQL(table), consumersScanned+1)
		if err != nil {
			return opErr(ctx, db, "listing the consumers", err)
		}
		n := 0
		for rows.Next() {
			var c string
			if err := rows.Scan(&c); err != nil {
				_ = rows.Close()
				return opErr(ctx, db, "listing the consumers", err)
			}
			if n++; n > consumersScanned {
				more = true
				break
			}
			set[c] = true
		}
		if err := seam.Close(rows); err != nil {
			return opErr(ctx, db, "listing the consumers", err)
		}
	}
	names := make([]string, 0, len(set))
	for c := range set {
		names = append(names, c)
	}
	sort.Strings(names) // byte order: the two tables' collations may differ
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
