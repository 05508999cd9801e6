package inboxdb

import (
	"context"
	"errors"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlexec"
)

// uniqueViolation is PostgreSQL's SQLSTATE for a duplicate key.
const uniqueViolation = "23505"

// BeginClaimPgx begins a transaction on conn and claims (consumer, key) in
// it, in one round trip: BEGIN and the inbox INSERT travel as one
// simple-protocol query. It is the fast path of ClaimTx for pgx
// connections; the semantics are the same.
//
// When it returns Claimed true, tx is open and holds the claim; the caller
// commits or rolls it back. When the key is already done, it rolls the
// attempt back, counts the duplicate in its own statement, and returns
// Claimed false with the existing record and a nil tx. conn is never left in
// a transaction by an error.
//
// consumer and key are sent as quoted literals (a multi-statement query
// takes no parameters); ValidateKey guarantees they are valid UTF-8
// without NUL, and conn must use standard_conforming_strings=on and UTF8
// client encoding (PostgreSQL's defaults; checked).
//
// On a connection whose pgx DefaultQueryExecMode is cache_statement (pgx's
// default, which keeps statements in the session: a direct connection,
// session pooling), the INSERT is a statement prepared once per session
// with SQL-level PREPARE (a round trip at the connection's first claim),
// and a claim is "BEGIN; EXECUTE <statement>('consumer', 'key')": neither
// parsed nor planned again. With any other exec mode (exec, which
// docs/pgbouncer.md asks for behind PgBouncer's transaction pooling), or
// with Config.LiteralClaim, it is "BEGIN; INSERT ... VALUES ('consumer',
// 'key', ...)": nothing kept in the session, so it works where
// consecutive round trips outside a transaction may run on different
// server connections. A prepared statement found missing from the session
// (26000), or a name found taken (42P05), turns the Store to the literal
// INSERT for good (Config.OnLiteralClaim); that claim is rolled back and
// made again. See preparedClaim.
//
// On the partitioned layout it makes two (see beginClaimPgxPartitioned),
// and claims again in a new transaction after ErrPartitionsChanged.
func (s *Store) BeginClaimPgx(ctx context.Context, conn *pgx.Conn, consumer, key string) (pgx.Tx, ClaimResult, error) {
	if err := s.ValidateKey(consumer, key); err != nil {
		return nil, ClaimResult{}, err
	}
	qc, err := conn.PgConn().EscapeString(consumer)
	if err != nil {
		return nil, ClaimResult{}, err
	}
	qk, err := conn.PgConn().EscapeString(key)
	if err != nil {
		return nil, ClaimResult{}, err
	}
	if s.part != nil {
		return s.beginClaimPgxPartitioned(ctx, conn, consumer, key, qc, qk)
	}
	prepared, err := s.prep.use(ctx, conn)
	if err != nil {
		return nil, ClaimResult{}, fmt.Errorf("claiming %q for %q: %w", key, consumer, err)
	}
	// A plain INSERT, not INSERT ... ON CONFLICT: a duplicate fails the
	// query with a unique violation, and the transaction with it.
	literal := func() string { return s.rt.beginLiteral.Fill(qc, qk) }
	var begin string
	if prepared {
		begin = s.prep.executeQuery(qc, qk)
	} else {
		begin = literal()
	}

	for attempt := 0; attempt < 4; attempt++ {
		tx, err := conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: begin})
		if err == nil {
			return tx, ClaimResult{Claimed: true}, nil
		}
		// A failed BEGIN query may leave conn in an aborted transaction.
		if conn.PgConn().TxStatus() != 'I' && !conn.IsClosed() {
			if _, rbErr := conn.Exec(context.WithoutCancel(ctx), s.q.get("Rollback")); rbErr != nil {
				return nil, ClaimResult{}, fmt.Errorf("rolling back a failed claim of %q for %q: %w", key, consumer, rbErr)
			}
		}
		if prepared && s.prep.missing(err) {
			// Nothing was written (the EXECUTE failed): claim again, with
			// the literal INSERT.
			prepared, begin = false, literal()
			continue
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != uniqueViolation {
			return nil, ClaimResult{}, fmt.Errorf("claiming %q for %q: %w", key, consumer, err)
		}
		// Already recorded: count the duplicate. Zero rows means the record
		// was deleted (Forget, Purge) in between: claim again.
		var rec Record
		err = conn.QueryRow(ctx, s.q.get("CountDuplicate"), consumer, key).Scan(rec.scanDest()...)
		if errors.Is(err, pgx.ErrNoRows) {
			continue
		}
		if err != nil {
			return nil, ClaimResult{}, fmt.Errorf("counting duplicate %q for %q: %w", key, consumer, err)
		}
		switch {
		case Settled(rec.Status):
			return nil, ClaimResult{Existing: rec}, nil
		case rec.Status == StatusFailed:
			if !rec.ParkedByTransaction {
				return nil, ClaimResult{Existing: rec}, notDone(consumer, key, rec)
			}
			// Released by an operator: rare, so the ordinary two round trips.
			tx, err := conn.Begin(ctx)
			if err != nil {
				return nil, ClaimResult{}, fmt.Errorf("claiming released %q for %q: begin: %w", key, consumer, err)
			}
			ok, err := s.reclaim(ctx, wsql.TxFromPgx(tx), consumer, key)
			if err != nil || !ok {
				_ = tx.Rollback(context.WithoutCancel(ctx))
				if err != nil {
					return nil, ClaimResult{}, fmt.Errorf("claiming released %q for %q: %w", key, consumer, err)
				}
				continue
			}
			return tx, ClaimResult{Claimed: true}, nil
		}
		return nil, ClaimResult{Existing: rec}, notDone(consumer, key, rec)
	}
	return nil, ClaimResult{}, fmt.Errorf("claiming %q for %q: the record kept disappearing (concurrent Forget or Purge)", key, consumer)
}

// BeginClaimPool acquires a connection from pool and begins + claims in
// one round trip (BeginClaimPgx). A nil tx with a nil error means the key
// was not claimed (a duplicate, or parked); the connection is then back in
// the pool.
func (s *Store) BeginClaimPool(ctx context.Context, pool *pgxpool.Pool, consumer, key string) (*sqlexec.PoolTx, ClaimResult, error) {
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, ClaimResult{}, err
	}
	tx, claim, err := s.BeginClaimPgx(ctx, conn.Conn(), consumer, key)
	if err != nil || !claim.Claimed {
		conn.Release()
		return nil, claim, err
	}
	return sqlexec.NewPoolTx(ctx, tx, conn), claim, nil
}
