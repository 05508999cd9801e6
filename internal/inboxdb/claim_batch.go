package inboxdb

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
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
// counts the duplicates among the rest. Keys must be distinct and valid
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
func (s *Store) ClaimBatchTx(ctx context.Context, tx wsql.ContextExecutor, consumer string, keys []string) ([]ClaimResult, []error, error) {
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

	insert := s.claimBatchPlain
	if s.part != nil {
		insert = s.claimBatchPartitioned
	}
	claimed, err := insert(ctx, tx, consumer, sorted)
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

	args := make([]any, 0, len(rest)+1)
	args = append(args, consumer)
	placeholders := make([]string, len(rest))
	for i, k := range rest {
		placeholders[i] = "$" + strconv.Itoa(i+2)
		args = append(args, k)
	}
	rows, err := tx.QueryContext(ctx, `UPDATE `+s.table+` SET duplicates = duplicates + CASE WHEN status IN `+settledSQL+` THEN 1 ELSE 0 END
WHERE consumer = $1 AND message_key IN (`+strings.Join(placeholders, ", ")+`)
RETURNING `+recordColumns, args...)
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
			ok, former, err := s.reclaim(ctx, tx, consumer, k)
			if err != nil {
				return nil, nil, fmt.Errorf("claiming released %q for %q: %w", k, consumer, err)
			}
			if ok {
				results[i] = ClaimResult{Claimed: true, FormerKeyFormat: former}
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
// the keys inserted.
func (s *Store) claimBatchPlain(ctx context.Context, tx wsql.ContextExecutor, consumer string, sorted []string) (map[string]bool, error) {
	args := make([]any, 0, len(sorted)+1)
	args = append(args, consumer)
	var values strings.Builder
	for i, k := range sorted {
		if i > 0 {
			values.WriteString(", ")
		}
		values.WriteString("($1, $" + strconv.Itoa(i+2) + ", 'done', 1, now())")
		args = append(args, k)
	}
	rows, err := tx.QueryContext(ctx, `INSERT INTO `+s.table+` (consumer, message_key, status, attempts, processed_at)
VALUES `+values.String()+`
ON CONFLICT (consumer, message_key) DO NOTHING
RETURNING message_key`, args...)
	return claimedKeys(rows, err, len(sorted), consumer)
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
