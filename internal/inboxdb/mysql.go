package inboxdb

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

// The MySQL/MariaDB steps that stand in for what PostgreSQL does in one
// statement (a data-modifying CTE, RETURNING): run in the caller's
// transaction, or in one of their own (inTx).

// inTx runs fn in db when db is a transaction, otherwise in a transaction
// of its own, run again after a deadlock or lock wait timeout as
// retryStatement does: the steps of one PostgreSQL statement stay atomic.
func inTx(ctx context.Context, db wsql.ContextExecutor, fn func(tx wsql.ContextExecutor) error) error {
	if _, ok := db.(wsql.Tx); ok {
		return fn(db)
	}
	b, ok := db.(wsql.Beginner)
	if !ok {
		return fn(db)
	}
	return retryStatement(db, func() error {
		tx, err := b.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if err := fn(tx); err != nil {
			_ = tx.Rollback()
			return err
		}
		return tx.Commit()
	})
}

// parkMySQL is Park on MySQL: the park's INSERT ... ON DUPLICATE KEY
// UPDATE, then, when it parked the key (affected rows 1 or 2), the kept
// message from the record, in one transaction.
func (s *Store) parkMySQL(ctx context.Context, db wsql.ContextExecutor, consumer, key, reason string, msg *ParkedMessage) error {
	err := inTx(ctx, db, func(tx wsql.ContextExecutor) error {
		n, err := seam.Exec(ctx, tx, s.q.get("Park"), consumer, key, reason, reason)
		if err != nil || n == 0 || msg == nil {
			return err
		}
		_, err = seam.Exec(ctx, tx, s.q.get("KeepParked"), append(msg.Row().args(), consumer, key)...)
		return err
	})
	if err != nil {
		return fmt.Errorf("parking %q for %q: %w", key, consumer, err)
	}
	return nil
}

// forgetMySQL is forget on MySQL: the record's DELETE, then the parked
// message's, in one transaction.
func (s *Store) forgetMySQL(ctx context.Context, db wsql.ContextExecutor, consumer, key string, waitingOnly bool) (record, message bool, err error) {
	q := s.q.get("ForgetRecord")
	if waitingOnly {
		q = s.q.get("ForgetWaitingRecord")
	}
	err = inTx(ctx, db, func(tx wsql.ContextExecutor) error {
		n, err := seam.Exec(ctx, tx, q, consumer, key)
		if err != nil {
			return err
		}
		m, err := seam.Exec(ctx, tx, s.q.get("DeleteParked"), consumer, key)
		record, message = n > 0, m > 0
		return err
	})
	if err != nil {
		return false, false, fmt.Errorf("forget %q for %q: %w", key, consumer, err)
	}
	return record, message, nil
}

// discardMySQL is DiscardTx on MySQL: the parked message's DELETE, then,
// when there was one, the record marked discarded.
func (s *Store) discardMySQL(ctx context.Context, tx wsql.ContextExecutor, consumer, key string) (bool, error) {
	n, err := seam.Exec(ctx, tx, s.q.get("DeleteParked"), consumer, key)
	if err == nil && n > 0 {
		_, err = seam.Exec(ctx, tx, s.q.get("DiscardMark"), consumer, key)
	}
	if err != nil {
		return false, fmt.Errorf("discarding the parked message of %q for %q: %w", key, consumer, err)
	}
	return n > 0, nil
}

// picked reads the (consumer, key) rows of a pick (DiscardParkedBatch,
// PurgePick).
func picked(rows wsql.Rows, err error) ([][2]string, error) {
	if err != nil {
		return nil, err
	}
	var out [][2]string
	for rows.Next() {
		var p [2]string
		if err := rows.Scan(&p[0], &p[1]); err != nil {
			_ = rows.Close()
			return nil, err
		}
		out = append(out, p)
	}
	return out, seam.Close(rows)
}

// byKey runs the statement q of one key (consumer, key: its only
// parameters) for each picked key, and returns the rows it affected. One
// statement per key: a primary-key look-up whatever the plan, where a
// DELETE of a list of keys, prepared, was planned as a scan by MariaDB
// 10.11, which, locking, waits for every row another transaction holds.
func byKey(ctx context.Context, tx wsql.ContextExecutor, q string, keys [][2]string) (int64, error) {
	var total int64
	for _, k := range keys {
		n, err := seam.Exec(ctx, tx, q, k[0], k[1])
		if err != nil {
			return total, err
		}
		total += n
	}
	return total, nil
}

// discardParkedBatchMySQL is DiscardParkedBatch on MySQL: the pick of the
// parked messages (SKIP LOCKED), their DELETE, and their records marked
// discarded (with forget: deleted while they wait for an operator).
func (s *Store) discardParkedBatchMySQL(ctx context.Context, tx wsql.Tx, where string, args []any, forget bool) (int64, error) {
	keys, err := picked(tx.QueryContext(ctx, s.rt.discardBatch[0].Fill(where), args...))
	if err != nil || len(keys) == 0 {
		return 0, err
	}
	n, err := byKey(ctx, tx, s.q.get("DeleteParked"), keys)
	if err != nil {
		return 0, err
	}
	records := s.q.get("DiscardMark")
	if forget {
		records = s.q.get("ForgetWaitingRecord")
	}
	if _, err := byKey(ctx, tx, records, keys); err != nil {
		return 0, err
	}
	return n, nil
}

// purgeBatchMySQL is one batch of Purge on MySQL, in tx (under the purge
// lock): the pick of the rows (q, SKIP LOCKED), then their DELETE.
func (s *Store) purgeBatchMySQL(ctx context.Context, tx wsql.Tx, q string, args []any) (int64, error) {
	keys, err := picked(tx.QueryContext(ctx, q, args...))
	if err != nil || len(keys) == 0 {
		return 0, err
	}
	return byKey(ctx, tx, s.q.get("ForgetRecord"), keys)
}

// purgeLockName is the name of the inbox table's purge lock on MySQL
// (GET_LOCK): a hash of the table's name, within MySQL's 64 characters.
func (s *Store) purgeLockName() string {
	h := sha256.Sum256([]byte(s.table))
	return "eo_purge_" + hex.EncodeToString(h[:20])
}

// likePrefix is the LIKE pattern (ESCAPE '!') of the strings that start
// with prefix: a tenant's keys on MySQL.
func likePrefix(prefix string) string {
	r := strings.NewReplacer("!", "!!", "%", "!%", "_", "!_")
	return r.Replace(prefix) + "%"
}
