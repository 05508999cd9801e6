package outboxdb

import (
	"context"
	"encoding/json"
	"sort"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

// The relay's batch on MySQL/MariaDB (queries/mysql/relay.sql): the
// semantics of PostgreSQL's ClaimKeyed and ClaimPlain, in several
// statements of the caller's READ COMMITTED transaction. The heads of keys
// are decided by non-locking reads and only then locked, by id, with SKIP
// LOCKED (see relay.sql for why).

// candidates bounds the ids a non-locking read proposes for the failed rows
// to lock: a few batches' worth, as the window of the fresh heads.
const candidates = 4

// claimMySQL is ClaimBatch on MySQL.
func (s *Store) claimMySQL(ctx context.Context, tx wsql.ContextExecutor, c Claim) ([]Claimed, error) {
	paused, err := jsonArray(c.Paused)
	if err != nil {
		return nil, err
	}
	// due: the failed rows a batch takes first, at most c.Retry of them;
	// they are taken again (this transaction's own locks do not skip), up
	// to the batch's room, when the fresh rows leave it some.
	var dueIDs []int64
	dueRead := false
	readDue := func() error {
		if dueRead {
			return nil
		}
		dueRead = true
		dueIDs, err = s.ids(ctx, tx, "DueHeads", paused, candidates*c.Size)
		return err
	}
	var retry []Claimed
	if c.Retry > 0 {
		if err := readDue(); err != nil {
			return nil, err
		}
		if retry, err = s.lockIDs(ctx, tx, "LockDue", dueIDs, paused, c.Retry); err != nil {
			return nil, err
		}
	}
	var fresh []Claimed
	if room := c.Size - len(retry); room > 0 {
		if c.Keyed {
			heads, err := s.ids(ctx, tx, "WindowHeads", paused, paused, paused, c.Window)
			if err != nil {
				return nil, err
			}
			fresh, err = s.lockIDs(ctx, tx, "LockFresh", heads, paused, room)
			if err != nil {
				return nil, err
			}
		} else {
			fresh, err = s.claimRows(ctx, tx, "FreshPlain", c.Size, paused, room)
			if err != nil {
				return nil, err
			}
		}
	}
	if room := c.Size - len(fresh); len(retry) < room && (c.Retry == 0 || len(retry) == c.Retry) {
		if err := readDue(); err != nil {
			return nil, err
		}
		if retry, err = s.lockIDs(ctx, tx, "LockDue", dueIDs, paused, room); err != nil {
			return nil, err
		}
	}
	taken := append(append(make([]Claimed, 0, len(fresh)+len(retry)), fresh...), retry...)
	sort.Slice(taken, func(i, j int) bool { return taken[i].ID < taken[j].ID })
	if c.Keyed {
		follow, err := s.follow(ctx, tx, c.Size, taken, paused)
		if err != nil {
			return nil, err
		}
		if len(follow) > 0 {
			taken = append(taken, follow...)
			sort.Slice(taken, func(i, j int) bool { return taken[i].ID < taken[j].ID })
		}
	}
	return taken, s.markBlocked(ctx, tx, taken)
}

// follow locks the followers of the batch's keyed heads (ClaimKeyed's
// follow_ids and follow): the batch's room left after the heads, shared
// among the keyed heads (at most ceil(room/keys) rows each), the rows of
// each key right after its head, oldest first.
func (s *Store) follow(ctx context.Context, tx wsql.ContextExecutor, size int, heads []Claimed, paused string) ([]Claimed, error) {
	room, keys := size-len(heads), 0
	for _, h := range heads {
		if h.OrderingKey != "" {
			keys++
		}
	}
	if room <= 0 || keys == 0 {
		return nil, nil
	}
	per := (room + keys - 1) / keys
	var ids []int64
	for _, h := range heads {
		if h.OrderingKey == "" {
			continue
		}
		next, err := s.ids(ctx, tx, "Follow", []byte(h.OrderingKey), h.ID, per)
		if err != nil {
			return nil, err
		}
		ids = append(ids, next...)
	}
	if len(ids) == 0 {
		return nil, nil
	}
	sort.Slice(ids, func(i, j int) bool { return ids[i] < ids[j] })
	if len(ids) > room {
		ids = ids[:room]
	}
	return s.lockIDs(ctx, tx, "LockFresh", ids, paused, len(ids))
}

// markBlocked flags the keyed rows of taken (in id order) that have an
// earlier row of their key outside the batch (relay.sql's Blocked).
func (s *Store) markBlocked(ctx context.Context, tx wsql.ContextExecutor, taken []Claimed) error {
	prev := map[string]int64{}
	var pairs [][2]int64
	for _, r := range taken {
		if r.OrderingKey == "" {
			continue
		}
		pairs = append(pairs, [2]int64{r.ID, prev[r.OrderingKey]})
		prev[r.OrderingKey] = r.ID
	}
	if len(pairs) == 0 {
		return nil
	}
	arg, err := json.Marshal(pairs)
	if err != nil {
		return err
	}
	blocked, err := s.ids(ctx, tx, "Blocked", string(arg))
	if err != nil {
		return err
	}
	set := make(map[int64]bool, len(blocked))
	for _, id := range blocked {
		set[id] = true
	}
	for i := range taken {
		taken[i].Blocked = set[taken[i].ID]
	}
	return nil
}

// lockIDs runs a locking statement (LockDue, LockFresh) on ids, a JSON
// array, with the paused topics and a limit.
func (s *Store) lockIDs(ctx context.Context, tx wsql.ContextExecutor, name string, ids []int64, paused string, limit int) ([]Claimed, error) {
	if len(ids) == 0 || limit <= 0 {
		return nil, nil
	}
	arg, err := json.Marshal(ids)
	if err != nil {
		return nil, err
	}
	return s.claimRows(ctx, tx, name, limit, string(arg), paused, limit)
}

// claimRows runs a statement that returns rows of a batch (the columns of
// Claimed but Blocked).
func (s *Store) claimRows(ctx context.Context, tx wsql.ContextExecutor, name string, size int, args ...any) ([]Claimed, error) {
	rows, err := tx.QueryContext(ctx, s.st.Get(name), args...)
	if err != nil {
		return nil, err
	}
	out := make([]Claimed, 0, size)
	for rows.Next() {
		var r Claimed
		var key []byte
		if err := rows.Scan(&r.ID, &r.Topic, &r.UUID, &r.Payload, &r.Metadata, &r.Retry, &key); err != nil {
			_ = rows.Close()
			return nil, err
		}
		if key != nil {
			r.OrderingKey = string(key)
		}
		out = append(out, r)
	}
	return out, seam.Close(rows)
}

// ids runs a statement that returns ids.
func (s *Store) ids(ctx context.Context, q wsql.ContextExecutor, name string, args ...any) ([]int64, error) {
	rows, err := q.QueryContext(ctx, s.st.Get(name), args...)
	if err != nil {
		return nil, err
	}
	var out []int64
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			_ = rows.Close()
			return nil, err
		}
		out = append(out, id)
	}
	return out, seam.Close(rows)
}

// jsonArray is v as a JSON array ("[]" for nil), a parameter of
// relay.sql's statements.
func jsonArray[T any](v []T) (string, error) {
	if v == nil {
		return "[]", nil
	}
	b, err := json.Marshal(v)
	return string(b), err
}

// deleteMySQL is DeleteRelayed on MySQL.
func (s *Store) deleteMySQL(ctx context.Context, tx wsql.ContextExecutor, ids []int64) error {
	arg, err := jsonArray(ids)
	if err != nil {
		return err
	}
	_, err = tx.ExecContext(ctx, s.st.Get("DeleteRelayed"), arg)
	return err
}

// recordMySQL is RecordFailures on MySQL: one UPDATE per failed row (MySQL
// has no UPDATE ... FROM unnest, and a multi-table UPDATE does not say in
// which order it assigns), then the rows as they are now.
func (s *Store) recordMySQL(ctx context.Context, tx wsql.ContextExecutor, failed []Failure, b Backoff) ([]Recorded, error) {
	ids := make([]int64, len(failed))
	for i, f := range failed {
		ids[i] = f.ID
		permanent, defect := 0, 0
		if f.Permanent {
			permanent = 1
		}
		if f.Defect {
			defect = 1
		}
		if _, err := tx.ExecContext(ctx, s.st.Get("RecordFailure"),
			b.Base, b.Max, defect, permanent, b.MaxAttempts, f.Error, permanent, f.ID); err != nil {
			return nil, err
		}
	}
	arg, err := jsonArray(ids)
	if err != nil {
		return nil, err
	}
	rows, err := tx.QueryContext(ctx, s.st.Get("Recorded"), arg)
	if err != nil {
		return nil, err
	}
	out := make([]Recorded, 0, len(failed))
	for rows.Next() {
		var r Recorded
		if err := rows.Scan(&r.ID, &r.Topic, &r.UUID, &r.Attempts, &r.Failures, &r.Quarantined, &r.LastError); err != nil {
			_ = rows.Close()
			return nil, err
		}
		out = append(out, r)
	}
	return out, seam.Close(rows)
}
