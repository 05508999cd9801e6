// Package sqlschema owns the PostgreSQL tables of watermill-exactlyonce: the
// inbox (one row per processed message key and consumer) and the outbox
// (messages waiting for the relay).
//
// [DB] names the database and the tables once; every other package of the
// library takes the same value. The tables are created by explicit,
// versioned migrations embedded in the binary. Nothing is ever created
// implicitly at run time, and never inside a caller's transaction. Run
// [Migrate] at start-up (it is idempotent, and safe when several instances
// start at once: it takes a PostgreSQL advisory lock), or take the SQL text
// from [SQL] and feed it to goose, golang-migrate, atlas or whatever tool
// owns your schema. [Check] tells whether the tables are up to date; the
// middleware and the relay report missing tables as [ErrNotMigrated], a
// configuration error with the fix in its text, never as an outage.
//
// Schema and table names are checked against a strict pattern and quoted,
// so configuration cannot inject SQL.
package sqlschema
