package inboxdb

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/pgerr"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

// The partitioned layout's claim functions (migration inbox_002): the
// key's lock, the look-up in every partition and the insert, in one
// PL/pgSQL call. A claim at clock_timestamp() (a partition covers now and
// the next interval: the usual case) calls them; a fallback write (see
// placement) keeps its statements of its own, which take the fallback lock
// and read the newest partition's end from the catalog.
//
// They change no guarantee: the function takes the same lock (one
// definition, inboxpart.LockKey), and, being VOLATILE, runs its look-up
// and insert as a later statement with a snapshot taken after the lock was
// granted (READ COMMITTED; it refuses other levels). What they save is a
// round trip per claim (the pgx fast path sends the call with its BEGIN),
// and the planning of the look-up over every partition, which PostgreSQL
// now caches with the function, in the server process: nothing is kept in
// the client's session, so it works behind PgBouncer in transaction
// pooling as well (where the client's statements are not prepared, and
// the look-up was planned at every claim).

// funcState records whether the claim functions exist, as a store last
// found out.
type funcState struct {
	mu      sync.Mutex // never held across a round trip (see partitionState.mu)
	present bool
	checked time.Time // zero: never
	gen     uint64    // counts functionMissing: a look-up that began before does not store what it read
	off     bool      // tests and benchmarks: never use them
}

// useFunctions reports whether a claim may call the claim functions: they
// exist (asked through db at the first claim, and again at most every
// refreshEvery while they are missing: a table whose functions are
// missing claims by statements of its own).
func (s *Store) useFunctions(ctx context.Context, db wsql.ContextExecutor) bool {
	f := &s.part.funcs
	f.mu.Lock()
	if f.off || f.present || (!f.checked.IsZero() && time.Since(f.checked) < refreshEvery) {
		present := !f.off && f.present
		f.mu.Unlock()
		return present
	}
	f.checked = time.Now() // the other claims meanwhile claim by statements
	gen := f.gen
	f.mu.Unlock()
	var ok bool
	if err := seam.QueryRow(ctx, db, s.q.get("ClaimFunctionsExist"), nil, &ok); err != nil {
		return false
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.gen != gen {
		return false
	}
	f.present = ok
	return ok
}

// functionMissing makes the store claim without the functions until it
// next looks for them (one was dropped since it looked).
func (s *Store) functionMissing() {
	f := &s.part.funcs
	f.mu.Lock()
	f.present = false
	f.checked = time.Now()
	f.gen++
	f.mu.Unlock()
}

// undefinedFunction is SQLSTATE undefined_function.
const undefinedFunction = "42883"

// claimFunctionGone reports whether err says that one of the store's
// claim functions does not exist.
func (s *Store) claimFunctionGone(err error) bool {
	return pgerr.Code(err) == undefinedFunction && strings.Contains(err.Error(), s.cfg.Tables.InboxTable+"_")
}

// claimBatchFunc is claimBatchPartitioned through the claim_batch
// function: the keys' locks in hash order, then the insert of the absent
// ones, in one statement.
func (s *Store) claimBatchFunc(ctx context.Context, tx wsql.ContextExecutor, consumer string, sorted []string) (map[string]bool, error) {
	rows, err := tx.QueryContext(ctx, s.q.get("ClaimBatchFuncCall"), consumer, sorted)
	keys, err := claimedKeys(rows, err, len(sorted), consumer)
	return keys, s.partitionsChanged(err)
}

// beginClaimPgxFunc is BeginClaimPgx on the partitioned layout for a claim
// at clock_timestamp(), in one round trip: BEGIN and the call of the
// raising claim function travel as one simple-protocol query, as the plain
// layout's BEGIN and INSERT do. A duplicate fails it with 23505; then the
// ROLLBACK and the call of the duplicate function (which counts it, under
// the key's lock) travel as one more. done false: claim by the statements
// of the general path instead (a key released by an operator, or the
// functions were dropped).
func (s *Store) beginClaimPgxFunc(ctx context.Context, conn *pgx.Conn, consumer, key, qc, qk string) (tx pgx.Tx, claim ClaimResult, done bool, err error) {
	for range 3 {
		tx, err := conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: s.rt.beginFunc.Fill(qc, qk)})
		if err == nil {
			return tx, ClaimResult{Claimed: true}, true, nil
		}
		dup := pgerr.Code(err) == uniqueViolation && strings.Contains(err.Error(), inboxpart.DuplicateMarker)
		inTx := conn.PgConn().TxStatus() != 'I' && !conn.IsClosed()
		if !dup {
			// A failed BEGIN query may leave conn in an aborted transaction.
			if inTx {
				if _, rbErr := conn.Exec(context.WithoutCancel(ctx), s.q.get("Rollback")); rbErr != nil {
					return nil, ClaimResult{}, true, fmt.Errorf("rolling back a failed claim of %q for %q: %w", key, consumer, rbErr)
				}
			}
			if s.claimFunctionGone(err) {
				s.functionMissing()
				return nil, ClaimResult{}, false, nil
			}
			return nil, ClaimResult{}, true, fmt.Errorf("claiming %q for %q: %w", key, consumer, s.partitionsChanged(err))
		}
		// Already recorded: roll back and count the duplicate, in one round
		// trip. Zero rows: the record was deleted (Forget, Purge) in
		// between: claim again.
		q := s.rt.duplicateFunc.Fill(qc, qk)
		if inTx {
			q = s.rt.rollbackDuplicateFunc.Fill(qc, qk)
		}
		rec, found, err := s.countDuplicatePgx(ctx, conn, q)
		if err != nil {
			return nil, ClaimResult{}, true, fmt.Errorf("counting duplicate %q for %q: %w", key, consumer, err)
		}
		if !found {
			continue
		}
		switch {
		case Settled(rec.Status):
			return nil, ClaimResult{Existing: rec}, true, nil
		case rec.Status == StatusFailed:
			if rec.ParkedByTransaction {
				// Released by an operator: rare, so the general path.
				return nil, ClaimResult{}, false, nil
			}
		}
		return nil, ClaimResult{Existing: rec}, true, notDone(consumer, key, rec)
	}
	return nil, ClaimResult{}, true, fmt.Errorf("claiming %q for %q: the record kept disappearing (concurrent Forget or Purge)", key, consumer)
}

// countDuplicatePgx runs q, a simple-protocol query whose last statement
// returns the duplicate function's row, and reads that row.
func (s *Store) countDuplicatePgx(ctx context.Context, conn *pgx.Conn, q string) (Record, bool, error) {
	results, err := conn.PgConn().Exec(ctx, q).ReadAll()
	if err == nil {
		for _, r := range results {
			if r.Err != nil {
				err = r.Err
				break
			}
		}
	}
	if err != nil {
		// The rollback ran (or the connection is gone): whatever failed
		// after it, conn is not left in a transaction it began.
		if conn.PgConn().TxStatus() != 'I' && !conn.IsClosed() {
			_, _ = conn.Exec(context.WithoutCancel(ctx), s.q.get("Rollback"))
		}
		return Record{}, false, err
	}
	last := results[len(results)-1]
	if len(last.Rows) == 0 {
		return Record{}, false, nil
	}
	var rec Record
	dest := rec.scanDest()
	if len(last.FieldDescriptions) != len(dest) {
		return Record{}, false, fmt.Errorf("the duplicate function returned %d columns, expected %d", len(last.FieldDescriptions), len(dest))
	}
	m := conn.TypeMap()
	for i, fd := range last.FieldDescriptions {
		if err := m.Scan(fd.DataTypeOID, fd.Format, last.Rows[0][i], dest[i]); err != nil {
			return Record{}, false, fmt.Errorf("reading column %s of the duplicate's record: %w", fd.Name, err)
		}
	}
	return rec, true, nil
}
