package inboxdb

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

// ErrVanished is a per-key error of ClaimBatchTx: the key's record was
// deleted (Forget, Purge) between the claim's two statements. Claim it
// again in a new transaction.
var ErrVanished = errors.New("the record disappeared during the claim (concurrent Forget or Purge)")

// ClaimBatchTx claims many keys of one consumer inside tx, the transaction
// that also holds their handlers' writes (group commit): one multi-row
// INSERT ... ON CONFLICT DO NOTHING for all of them, and one UPDATE that
// counts the duplicates among the rest (on MySQL/MariaDB: one multi-row
// INSERT ... ON DUPLICATE KEY UPDATE that also counts them, a locking read
// of the batch and an UPDATE of the new records, see claimBatchMySQL). Keys must be distinct and valid
// (ValidateKey). They are inserted in sorted order, so that two batches
// sharing keys, on two instances, take their row locks in the same order
// and cannot deadlock.
//
// It returns one ClaimResult per key, in the order given, with the
// semantics of ClaimTx, and one error per key (nil when the result holds):
// ErrNotDone for a lease-mode record that is processing, ErrVanished for a
// record deleted in between. The error result is for the statements
// themselves; then nothing is claimed. Under REPEATABLE READ or
// SERIALIZABLE, a key claimed by another transaction that commits while
// this one waits fails the statement with 40001: roll back and claim again
// (see ClaimTx); so does ErrPartitionsChanged on the partitioned layout.
//
// It is ClaimBatchCopiesTx with one delivery of each key.
func (s *Store) ClaimBatchTx(ctx context.Context, tx wsql.ContextExecutor, consumer string, keys []string) ([]ClaimResult, []error, error) {
	return s.ClaimBatchCopiesTx(ctx, tx, consumer, keys, nil)
}

// ClaimBatchCopiesTx is ClaimBatchTx for a batch that holds copies[i]
// deliveries of keys[i] (nil: one of each; otherwise one count, at least
// 1, per key). The caller runs the handler for one of them and reports the
// others as duplicates of it; the record counts them as their own claims
// would have, in the same transaction: a record this claim creates (or a
// released one it claims again) counts copies[i]-1 duplicates, a done or
// parked one copies[i]. A batch without copies runs the statements of
// ClaimBatchTx, nothing more; on the partitioned layout, whose insert
// (the claim_batch function of migration inbox_002) cannot set the count,
// a batch that created records of keys with copies adds their count with
// one more UPDATE.
func (s *Store) ClaimBatchCopiesTx(ctx context.Context, tx wsql.ContextExecutor, consumer string, keys []string, copies []int) ([]ClaimResult, []error, error) {
	if copies != nil && len(copies) != len(keys) {
		return nil, nil, fmt.Errorf("claiming %d keys for %q: %d copy counts given, want one per key", len(keys), consumer, len(copies))
	}
	results := make([]ClaimResult, len(keys))
	errs := make([]error, len(keys))
	if len(keys) == 0 {
		return results, errs, nil
	}
	index := make(map[string]int, len(keys))
	for i, k := range keys {
		index[k] = i
	}
	sorted := slices.Clone(keys)
	slices.Sort(sorted)
	// n returns the deliveries of key k in the batch.
	n := func(k string) int64 {
		if copies == nil {
			return 1
		}
		return int64(max(copies[index[k]], 1))
	}
	var sortedCopies []int64 // nil: no key has copies
	for i, k := range sorted {
		if c := n(k); c > 1 {
			if sortedCopies == nil {
				sortedCopies = make([]int64, len(sorted))
				for j := range sortedCopies {
					sortedCopies[j] = 1
				}
			}
			sortedCopies[i] = c
		}
	}

	if s.mysql {
		return s.claimBatchMySQL(ctx, tx, consumer, keys, sorted, n)
	}
	var claimed map[string]bool
	var err error
	if s.part == nil {
		claimed, err = s.claimBatchPlain(ctx, tx, consumer, sorted, sortedCopies)
	} else {
		claimed, err = s.claimBatchPartitioned(ctx, tx, consumer, sorted)
		if err == nil && sortedCopies != nil {
			err = s.countInsertedCopies(ctx, tx, consumer, sorted, sortedCopies, claimed)
		}
	}
	if err != nil {
		return nil, nil, err
	}

	var rest []string
	for _, k := range sorted {
		if claimed[k] {
			results[index[k]] = ClaimResult{Claimed: true}
		} else {
			rest = append(rest, k)
		}
	}
	if len(rest) == 0 {
		return results, errs, nil
	}

	var rows wsql.Rows
	restCopies := make([]int64, len(rest))
	withCopies := false
	for i, k := range rest {
		restCopies[i] = n(k)
		withCopies = withCopies || restCopies[i] > 1
	}
	if withCopies {
		// A released record (failed, parked by a transaction) is claimed
		// again below: its first copy runs, the others are duplicates.
		rows, err = tx.QueryContext(ctx, s.q.get("CountBatchDuplicatesCopies"), consumer, rest, restCopies)
	} else {
		rows, err = tx.QueryContext(ctx, s.q.get("CountBatchDuplicates"), consumer, rest)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("counting duplicates for %q: %w", consumer, err)
	}
	found := make(map[string]Record, len(rest))
	for rows.Next() {
		var rec Record
		if err := rows.Scan(rec.scanDest()...); err != nil {
			_ = rows.Close()
			return nil, nil, fmt.Errorf("counting duplicates for %q: %w", consumer, err)
		}
		found[rec.Key] = rec
	}
	if err := seam.Close(rows); err != nil {
		return nil, nil, fmt.Errorf("counting duplicates for %q: %w", consumer, err)
	}
	for _, k := range rest {
		i := index[k]
		rec, ok := found[k]
		switch {
		case !ok:
			errs[i] = fmt.Errorf("%q for %q: %w", k, consumer, ErrVanished)
		case Settled(rec.Status):
			results[i] = ClaimResult{Existing: rec}
		case rec.Status == StatusFailed && rec.ParkedByTransaction:
			ok, err := s.reclaim(ctx, tx, consumer, k)
			if err != nil {
				return nil, nil, fmt.Errorf("claiming released %q for %q: %w", k, consumer, err)
			}
			if ok {
				results[i] = ClaimResult{Claimed: true}
			} else {
				errs[i] = fmt.Errorf("%q for %q: %w", k, consumer, ErrVanished)
			}
		default:
			results[i] = ClaimResult{Existing: rec}
			errs[i] = notDone(consumer, k, rec)
		}
	}
	return results, errs, nil
}

// claimBatchPlain inserts the keys (sorted) on the plain layout, returning
// the keys inserted. With copies (one count per key, nil when no key has
// copies), a record inserted counts copies-1 duplicates.
func (s *Store) claimBatchPlain(ctx context.Context, tx wsql.ContextExecutor, consumer string, sorted []string, copies []int64) (map[string]bool, error) {
	var rows wsql.Rows
	var err error
	if copies == nil {
		rows, err = tx.QueryContext(ctx, s.q.get("ClaimBatchInsert"), consumer, sorted)
	} else {
		extra := make([]int64, len(copies))
		for i, c := range copies {
			extra[i] = c - 1
		}
		rows, err = tx.QueryContext(ctx, s.q.get("ClaimBatchInsertCopies"), consumer, sorted, extra)
	}
	return claimedKeys(rows, err, len(sorted), consumer)
}

// countInsertedCopies counts, on the partitioned layout, the copies of the
// keys whose records the batch's insert created (claimed) as duplicates:
// copies-1 each (copies: one count per sorted key). The insert, through
// the claim_batch function or the fallback statements, cannot; the
// records are the transaction's own, under the keys' locks it holds.
func (s *Store) countInsertedCopies(ctx context.Context, tx wsql.ContextExecutor, consumer string, sorted []string, copies []int64, claimed map[string]bool) error {
	var keys []string
	var extra []int64
	for i, k := range sorted {
		if claimed[k] && copies[i] > 1 {
			keys = append(keys, k)
			extra = append(extra, copies[i]-1)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	if _, err := tx.ExecContext(ctx, s.q.get("CountInsertedCopies"), consumer, keys, extra); err != nil {
		return fmt.Errorf("counting the duplicates within the batch for %q: %w", consumer, err)
	}
	return nil
}

// claimedKeys reads the keys a batch claim's INSERT ... RETURNING
// message_key returned (rows and err are the query's): the keys this
// transaction claimed.
func claimedKeys(rows wsql.Rows, err error, n int, consumer string) (map[string]bool, error) {
	if err != nil {
		return nil, fmt.Errorf("claiming %d keys for %q: %w", n, consumer, err)
	}
	claimed := make(map[string]bool, n)
	for rows.Next() {
		var k string
		if err := rows.Scan(&k); err != nil {
			_ = rows.Close()
			return nil, fmt.Errorf("claiming %d keys for %q: %w", n, consumer, err)
		}
		claimed[k] = true
	}
	if err := seam.Close(rows); err != nil {
		return nil, fmt.Errorf("claiming %d keys for %q: %w", n, consumer, err)
	}
	return claimed, nil
}

// claimBatchMySQL is ClaimBatchCopiesTx on MySQL/MariaDB
// (queries/mysql/claim.sql): one multi-row INSERT ... ON DUPLICATE KEY
// UPDATE of the sorted keys, which inserts the new ones with their count
// negated (the transaction's own mark) and counts the duplicates on the
// others; one locking read of the batch's records (a point read per key,
// joined: an IN list would lock the gaps between the keys under REPEATABLE
// READ, see claim.sql), which tells the inserted (negative count) from the
// others (the latest committed rows: a key another transaction claimed and
// committed meanwhile is a duplicate, counted); a point UPDATE per
// inserted record that sets its count (copies-1). The insert holds the row locks of every key from then on:
// no record vanishes in between. A deadlock (1213) between batches
// (against the sorted order, e.g. with single claims) is returned as is:
// roll back and claim again.
func (s *Store) claimBatchMySQL(ctx context.Context, tx wsql.ContextExecutor, consumer string, keys, sorted []string, n func(string) int64) ([]ClaimResult, []error, error) {
	rows := make([]string, len(sorted))
	reads := make([]string, len(sorted))
	insertArgs := make([]any, 0, 3*len(sorted))
	readArgs := make([]any, 0, 2*len(sorted))
	row, read := s.q.get("ClaimBatchRow"), s.q.get("ClaimBatchLockOne")
	for i, k := range sorted {
		rows[i], reads[i] = row, read
		insertArgs = append(insertArgs, consumer, k, -n(k))
		readArgs = append(readArgs, consumer, k)
	}
	if _, err := seam.Exec(ctx, tx, s.rt.claimBatchInsert.Fill(strings.Join(rows, ", ")), insertArgs...); err != nil {
		return nil, nil, fmt.Errorf("claiming %d keys for %q: %w", len(sorted), consumer, err)
	}
	rs, err := tx.QueryContext(ctx, s.rt.claimBatchLock.Fill(strings.Join(reads, " UNION ALL ")), readArgs...)
	if err != nil {
		return nil, nil, fmt.Errorf("counting duplicates for %q: %w", consumer, err)
	}
	found := make(map[string]Record, len(sorted))
	for rs.Next() {
		var rec Record
		if err := rs.Scan(rec.scanDest()...); err != nil {
			_ = rs.Close()
			return nil, nil, fmt.Errorf("counting duplicates for %q: %w", consumer, err)
		}
		found[rec.Key] = rec
	}
	if err := seam.Close(rs); err != nil {
		return nil, nil, fmt.Errorf("counting duplicates for %q: %w", consumer, err)
	}
	for _, k := range sorted {
		if rec, ok := found[k]; ok && rec.Duplicates < 0 {
			if _, err := seam.Exec(ctx, tx, s.q.get("ClaimBatchFix"), consumer, k); err != nil {
				return nil, nil, fmt.Errorf("counting the duplicates within the batch for %q: %w", consumer, err)
			}
		}
	}
	results := make([]ClaimResult, len(keys))
	errs := make([]error, len(keys))
	for i, k := range keys {
		rec, ok := found[k]
		switch {
		case !ok:
			errs[i] = fmt.Errorf("%q for %q: %w", k, consumer, ErrVanished)
		case rec.Duplicates < 0:
			results[i] = ClaimResult{Claimed: true}
		case Settled(rec.Status):
			results[i] = ClaimResult{Existing: rec}
		case rec.Status == StatusFailed && rec.ParkedByTransaction:
			ok, err := s.reclaim(ctx, tx, consumer, k)
			if err != nil {
				return nil, nil, fmt.Errorf("claiming released %q for %q: %w", k, consumer, err)
			}
			if ok {
				results[i] = ClaimResult{Claimed: true}
			} else {
				errs[i] = fmt.Errorf("%q for %q: %w", k, consumer, ErrVanished)
			}
		default:
			results[i] = ClaimResult{Existing: rec}
			errs[i] = notDone(consumer, k, rec)
		}
	}
	return results, errs, nil
}
