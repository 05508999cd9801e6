// Package sqlschema owns the PostgreSQL tables of watermill-exactlyonce: the
// inbox (one row per processed message key and consumer) and the outbox
// (messages waiting for the relay).
//
// The tables are created by explicit, versioned migrations embedded in the
// binary. Nothing is ever created implicitly at run time, and never inside a
// caller's transaction. Run [Migrate] at start-up (it is idempotent, and safe
// when several instances start at once: it takes a PostgreSQL advisory lock),
// or take the SQL text from [SQL] / [Migrations] and feed it to goose,
// golang-migrate, atlas or whatever tool owns your schema.
//
// Schema and table names are configurable through [Config]. Names are checked
// against a strict pattern and quoted, so configuration cannot inject SQL.
package sqlschema
