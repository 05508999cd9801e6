package inboxdb

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlexec"
)

// The SQLSTATEs that say a SQL-level prepared statement of this client
// connection is not in the server session its query ran in: the server
// connection changed under the client (a connection pooler in transaction
// or statement pooling), or someone deallocated it.
const (
	undefinedPreparedStatement = "26000" // EXECUTE: no such statement
	duplicatePreparedStatement = "42P05" // PREPARE: the name is taken
)

// preparedClaim is the prepared statement of a Store's pgx fast path
// (BeginClaimPgx on the plain layout): the claim's INSERT, prepared with
// SQL-level PREPARE once per connection, so that a claim is "BEGIN;
// EXECUTE name('consumer', 'key')", one simple-protocol query whose INSERT
// is neither parsed nor planned again.
//
// A connection uses it only when its pgx DefaultQueryExecMode is
// QueryExecModeCacheStatement (pgx's default): that mode keeps named
// statements in the session itself, so it works only where the session
// stays the client's (a direct connection, session pooling). With any other
// mode (exec, as docs/pgbouncer.md asks behind PgBouncer's transaction
// pooling), or with Config.LiteralClaim, claims send the INSERT as
// literals, keeping nothing in the session.
//
// If the server still reports that the statement this connection prepared
// does not exist (26000), or that its name is taken when the connection
// prepares it (42P05), the session is not the connection's own: the Store
// claims with the literal INSERT from then on, on every connection, and
// calls Config.OnLiteralClaim once. The claim that met it is rolled back
// (the failed statement aborted its transaction: nothing was written) and
// made again with the literal INSERT.
type preparedClaim struct {
	// name is the statement's name: "exactlyonce_claim_" and a hash of
	// the PREPARE statement (so of the table and of the INSERT's text).
	// Two Stores of one table share it; Stores of different tables, or
	// versions of the library whose INSERT differs, do not. pgx names its
	// own statements stmtcache_<hash> and, for Conn.Prepare, by the
	// caller's choice.
	name string
	// prepare creates it; execute is the claim's BEGIN query with it
	// (holes Consumer and Key: the escaped literals).
	prepare string
	execute sqlexec.Template
	// dataKey is the key of the connection's state (connClaimState) in
	// pgconn.PgConn.CustomData.
	dataKey string
	// off is set for good by Config.LiteralClaim or by the first claim
	// that found the statement missing or taken.
	off   atomic.Bool
	onOff func(cause error)
}

// connClaimState is what a connection knows about a Store's prepared
// claim. A missing entry: nothing yet (its exec mode is read at its first
// claim).
type connClaimState uint8

const (
	connPrepared connClaimState = iota + 1 // PREPAREd in this session
	connLiteral                            // exec mode other than cache_statement
)

// newPreparedClaim names the statement by a hash of its PREPARE
// (plain/claim.sql's ClaimPrepare, rendered for the table), and fills the
// name into the PREPARE and the EXECUTE.
func newPreparedClaim(rt runTemplates, cfg Config) *preparedClaim {
	sum := sha256.Sum256([]byte(rt.prepare.Sample()))
	name := "exactlyonce_claim_" + hex.EncodeToString(sum[:12])
	execute, err := sqlexec.NewTemplate(rt.beginExecute.Fill(name, sqlexec.Hole("Consumer"), sqlexec.Hole("Key")), "Consumer", "Key")
	if err != nil {
		panic("inboxdb: " + err.Error()) // the holes were checked by newRunTemplates
	}
	p := &preparedClaim{name: name, prepare: rt.prepare.Fill(name), execute: execute,
		dataKey: "github.com/exactlyonce/watermill-exactlyonce/claim:" + name, onOff: cfg.OnLiteralClaim}
	p.off.Store(cfg.LiteralClaim)
	return p
}

// use reports whether a claim on conn should EXECUTE the prepared
// statement, preparing it first if this session has not. On false with a
// nil error, the claim sends the literal INSERT. An error is the claim's:
// PREPARE failed for another reason than a taken name (the table is
// missing, the connection broke).
func (p *preparedClaim) use(ctx context.Context, conn *pgx.Conn) (bool, error) {
	if p.off.Load() {
		return false, nil
	}
	data := conn.PgConn().CustomData()
	switch data[p.dataKey] {
	case connPrepared:
		return true, nil
	case connLiteral:
		return false, nil
	}
	if conn.Config().DefaultQueryExecMode != pgx.QueryExecModeCacheStatement {
		data[p.dataKey] = connLiteral
		return false, nil
	}
	if _, err := conn.Exec(ctx, p.prepare); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == duplicatePreparedStatement && !conn.IsClosed() {
			// This connection never prepared it here: another client did,
			// in the session we were given. A pooler.
			p.turnOff(fmt.Errorf("preparing the claim as %s: %w", p.name, err))
			return false, nil
		}
		return false, fmt.Errorf("preparing the claim: %w", err)
	}
	data[p.dataKey] = connPrepared
	return true, nil
}

// missing reports whether err, from a claim that used the prepared
// statement, says that the statement is not in the session: then the Store
// turns the prepared claim off for good.
func (p *preparedClaim) missing(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != undefinedPreparedStatement {
		return false
	}
	p.turnOff(fmt.Errorf("executing the claim's prepared statement %s: %w", p.name, err))
	return true
}

func (p *preparedClaim) turnOff(cause error) {
	if p.off.CompareAndSwap(false, true) && p.onOff != nil {
		p.onOff(cause)
	}
}

// executeQuery is the claim's BEGIN query with the prepared statement;
// qc and qk are the escaped consumer and key.
func (p *preparedClaim) executeQuery(qc, qk string) string {
	return p.execute.Fill(qc, qk)
}
