// Command exactlyonce is the operator's tool for the tables of
// watermill-exactlyonce: it migrates them, inspects and edits the inbox
// (stats, one key's record, forget, parked keys, release, retention purge),
// finds, shows, replays and discards parked messages (PostgreSQL or the
// Redis lease store), finds, requeues and discards quarantined outbox rows,
// and runs the outbox relay standalone towards RabbitMQ.
//
//	go install github.com/exactlyonce/watermill-exactlyonce/cmd/exactlyonce@latest
//	export DATABASE_URL=postgres://user@host:5432/db
//	exactlyonce migrate status
//	exactlyonce inbox parked
//	AMQP_URL=amqp://guest:guest@localhost:5672/ exactlyonce outbox relay
//
// The database comes from --database-url or DATABASE_URL, the broker from
// --amqp-url or AMQP_URL, the schema and table names from --schema,
// --inbox-table and --outbox-table (or EXACTLYONCE_SCHEMA,
// EXACTLYONCE_INBOX_TABLE, EXACTLYONCE_OUTBOX_TABLE), with the library's
// defaults. Output is for humans unless --json is given: then every command
// prints one JSON document on standard output. Errors go to standard error,
// one line each.
//
// Exit status: 0 success; 1 the operation failed (database or broker
// unreachable, tables not migrated, relay failures); 2 usage error (bad
// flags or arguments); 3 the record asked for does not exist (inbox show,
// forget, release; parked show, replay, discard, release), or the consumer
// given has no record at all in the inbox (a misspelled name: the error
// lists the consumers that have records).
//
// When the tables are not where --schema, --inbox-table and --outbox-table
// say, the error names the schema or tables that hold them (found in the
// catalog) instead of advising 'exactlyonce migrate up', which would create
// empty tables in the wrong place.
//
// Every command has --help; docs/cli.md is the guide to the operator tasks.
package main

import (
	"os"
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}
