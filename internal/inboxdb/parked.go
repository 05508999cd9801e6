package inboxdb

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/parked"
	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/tenant"
)

// The operators' side of the table of parked messages (<inbox>_parked,
// migration inbox_001): find, count, show, and the steps of a replay or a
// discard. The middleware writes the rows (with the park); these read them
// and remove them.
//
// Lock order: a statement that changes both the inbox record and the
// parked message of a key locks the record first (on the partitioned
// layout, the key's advisory lock before it), then the parked message, as
// a park does; so a replay, a discard, a forget and a park of one key
// cannot deadlock. (DiscardParkedBatch with forget is the exception: it
// picks the parked messages first, and runs again after a deadlock.)

// ErrNoParkedMessage is returned (wrapped) when (consumer, key) has no
// parked message: never parked with its content, or replayed, discarded
// or forgotten since.
var ErrNoParkedMessage = errors.New("no parked message for this consumer and key (replayed or discarded meanwhile, or never parked with its content)")

// ParkedRow is one row of the table of parked messages, with the key's
// inbox status.
type ParkedRow struct {
	Consumer string
	Key      string
	// Message is the message; its Payload is nil when it was not read
	// (FindParked without payloads) or not kept (Kept).
	Message ParkedMessage
	// Kept reports whether the payload was kept.
	Kept        bool
	Reason      string
	Attempts    int
	FirstSeenAt time.Time
	ParkedAt    time.Time
	// Status is the status of the key's inbox record now; "" when it has
	// none.
	Status string
}

// Cursor is the row's position in the order of FindParked.
func (r ParkedRow) Cursor() parked.Cursor {
	return parked.Cursor{ParkedAt: r.ParkedAt, Consumer: r.Consumer, Key: r.Key}
}

func scanParked(rows wsql.Rows) (ParkedRow, error) {
	var r ParkedRow
	var meta string
	if err := rows.Scan(&r.Consumer, &r.Key, &r.Message.UUID, &r.Message.Topic, &r.Message.Payload, &r.Kept,
		&r.Message.PayloadSize, &meta, &r.Reason, &r.Attempts, &r.FirstSeenAt, &r.ParkedAt, &r.Status); err != nil {
		return ParkedRow{}, err
	}
	md, err := decodeMetadata(meta)
	if err != nil {
		return ParkedRow{}, fmt.Errorf("metadata of %q for %q: %w", r.Key, r.Consumer, err)
	}
	r.Message.Metadata = md
	return r, nil
}

// decodeMetadata reads the metadata column: a JSON object whose values the
// middleware writes as strings; any other value (written by hand) is kept
// as its JSON text.
func decodeMetadata(s string) (map[string]string, error) {
	// The middleware writes strings only: one decode (a page of 1,000
	// spent 11 ms in the two below).
	var md map[string]string
	if json.Unmarshal([]byte(s), &md) == nil && md != nil {
		return md, nil
	}
	var raw map[string]json.RawMessage
	if err := json.Unmarshal([]byte(s), &raw); err != nil {
		return nil, err
	}
	md = make(map[string]string, len(raw))
	for k, v := range raw {
		var str string
		if json.Unmarshal(v, &str) == nil {
			md[k] = str
		} else {
			md[k] = string(v)
		}
	}
	return md, nil
}

// parkedWhere returns the conditions of f (and of the position after c,
// when not nil) on the parked table as p, appending their arguments to
// args; "true" when there is none. f must be valid (parked.Filter.Validate).
// They fill the Where hole of parked.sql's run-time templates: only the
// conditions of the fields set, so that the planner sees them as written
// (see parked.sql).
func (s *Store) parkedWhere(f parked.Filter, c *parked.Cursor, args *[]any) (string, error) {
	if s.mysql {
		return parkedWhereMySQL(f, c, args)
	}
	return parkedWhere(f, c, args)
}

// filterArgs is the Where hole of a filter's statement that ends in LIMIT
// and its arguments: the limit first on PostgreSQL ($1), last on MySQL
// (the order of the ? in the text).
func (s *Store) filterArgs(f parked.Filter, c *parked.Cursor, limit int) (string, []any, error) {
	if s.mysql {
		var args []any
		where, err := parkedWhereMySQL(f, c, &args)
		return where, append(args, limit), err
	}
	args := []any{limit}
	where, err := parkedWhere(f, c, &args)
	return where, args, err
}

// parkedWhereMySQL is parkedWhere on MySQL: the same conditions, each
// argument a ? in the order of the text (a cursor's time twice). A tenant
// is a LIKE prefix (likePrefix); the reason a case-insensitive substring;
// metadata JSON_CONTAINS; times DATETIME(6) in UTC.
func parkedWhereMySQL(f parked.Filter, c *parked.Cursor, args *[]any) (string, error) {
	var conds []string
	arg := func(v any) string {
		*args = append(*args, v)
		return "?"
	}
	if f.Consumer != "" {
		conds = append(conds, `p.consumer = `+arg(f.Consumer))
	}
	if f.Key != "" {
		conds = append(conds, `p.message_key = `+arg(f.Key))
	}
	if f.MessageUUID != "" {
		conds = append(conds, `p.message_uuid = `+arg(f.MessageUUID))
	}
	if f.Tenant != "" {
		conds = append(conds, `p.message_key LIKE `+arg(likePrefix(tenant.Prefix(f.Tenant)))+` ESCAPE '!'`)
	}
	if f.Reason != "" {
		conds = append(conds, `LOCATE(LOWER(`+arg(f.Reason)+`), LOWER(p.reason)) > 0`)
	}
	if !f.Since.IsZero() {
		conds = append(conds, `p.parked_at >= `+arg(f.Since.UTC()))
	}
	if !f.Before.IsZero() {
		conds = append(conds, `p.parked_at < `+arg(f.Before.UTC()))
	}
	meta, err := f.MetadataJSON()
	if err != nil {
		return "", err
	}
	if meta != "" {
		conds = append(conds, `JSON_CONTAINS(p.metadata, `+arg(meta)+`)`)
	}
	if c != nil {
		conds = append(conds, `p.parked_at >= `+arg(c.ParkedAt.UTC())+` AND (p.parked_at, p.consumer, p.message_key) > (`+
			arg(c.ParkedAt.UTC())+`, `+arg(c.Consumer)+`, `+arg(c.Key)+`)`)
	}
	if len(conds) == 0 {
		return "TRUE", nil
	}
	return strings.Join(conds, " AND "), nil
}

// parkedWhere is the PostgreSQL conditions of (*Store).parkedWhere.
func parkedWhere(f parked.Filter, c *parked.Cursor, args *[]any) (string, error) {
	var conds []string
	arg := func(v any) string {
		*args = append(*args, v)
		return "$" + strconv.Itoa(len(*args))
	}
	if f.Consumer != "" {
		conds = append(conds, `p.consumer = `+arg(f.Consumer))
	}
	if f.Key != "" {
		conds = append(conds, `p.message_key = `+arg(f.Key))
	}
	if f.MessageUUID != "" {
		conds = append(conds, `p.message_uuid = `+arg(f.MessageUUID))
	}
	if f.Tenant != "" {
		conds = append(conds, `starts_with(p.message_key, `+arg(tenant.Prefix(f.Tenant))+`)`)
	}
	if f.Reason != "" {
		conds = append(conds, `strpos(lower(p.reason), lower(`+arg(f.Reason)+`)) > 0`)
	}
	if !f.Since.IsZero() {
		conds = append(conds, `p.parked_at >= `+arg(f.Since)+`::timestamptz`)
	}
	if !f.Before.IsZero() {
		conds = append(conds, `p.parked_at < `+arg(f.Before)+`::timestamptz`)
	}
	meta, err := f.MetadataJSON()
	if err != nil {
		return "", err
	}
	if meta != "" {
		conds = append(conds, `p.metadata @> `+arg(meta)+`::jsonb`)
	}
	if c != nil {
		at := arg(c.ParkedAt)
		conds = append(conds, `p.parked_at >= `+at+`::timestamptz AND (p.parked_at, p.consumer COLLATE "C", p.message_key COLLATE "C") > (`+
			at+`::timestamptz, `+arg(c.Consumer)+`::text COLLATE "C", `+arg(c.Key)+`::text COLLATE "C")`)
	}
	if len(conds) == 0 {
		return "true", nil
	}
	return strings.Join(conds, " AND "), nil
}

// FindParked returns up to limit parked messages that match f, after c
// (nil: from the first), in the order of parked time, consumer and key,
// with their payloads when payloads is true. f must be valid.
func (s *Store) FindParked(ctx context.Context, db wsql.ContextExecutor, f parked.Filter, c *parked.Cursor, limit int, payloads bool) ([]ParkedRow, error) {
	q, args, err := s.findParkedSQL(f, c, limit, payloads, keysFirst(f))
	if err != nil {
		return nil, err
	}
	return s.queryParked(ctx, db, q, args...)
}

// keysFirst reports whether FindParked reads the page's keys first, from
// the parked_consumer_at index, and then their rows: when f names a consumer and
// every other condition of f is on the index's columns (the time range, a
// tenant: a key prefix; the cursor's too). For the plain query of a
// consumer alone the planner does not choose that index: it expects the
// consumer's messages spread over time, and walks the parked_at index
// (the oldest first) until it has found a page, which reads most of the
// table for a consumer whose messages are all recent (an incident). The
// keys alone are an index-only scan, which it prices below that walk
// while most of the table's pages are all-visible (vacuumed: autovacuum
// keeps them so). The other conditions have their own indexes (a key:
// the primary key; a message UUID; metadata) or none (the reason's
// text), and keep the plain query.
func keysFirst(f parked.Filter) bool {
	return f.Consumer != "" && f.Key == "" && f.MessageUUID == "" && f.Reason == "" && len(f.Metadata) == 0
}

// findParkedSQL is FindParked's query and its arguments. With keysFirst,
// a materialized CTE selects the page's keys (consumer, key) in the
// order of the parked_consumer_at index, which within one consumer is parkedOrder
// (an index-only scan of the consumer's range, the limit applied there);
// the rows are then read by the primary key and sorted in parkedOrder
// (the page only). The rows, their order and the limit are the plain
// query's.
func (s *Store) findParkedSQL(f parked.Filter, c *parked.Cursor, limit int, payloads, keysFirst bool) (string, []any, error) {
	if keysFirst && f.Consumer == "" {
		return "", nil, errors.New("inboxdb: findParkedSQL: keys first needs a consumer")
	}
	// Without keysFirst, the page first, then the records' status: joined
	// before the LIMIT, a plan that sorts the matches (a bounded scan's)
	// would look up the record of each match in the inbox, not of the
	// page's only (4,485 look-ups, 67 ms, for a page of 51).
	where, args, err := s.filterArgs(f, c, limit)
	if err != nil {
		return "", nil, err
	}
	return s.rt.findParked[b2i(keysFirst)][b2i(payloads)].Fill(where), args, nil
}

func (s *Store) queryParked(ctx context.Context, db wsql.ContextExecutor, q string, args ...any) ([]ParkedRow, error) {
	rows, err := db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, fmt.Errorf("finding parked messages: %w", err)
	}
	var out []ParkedRow
	for rows.Next() {
		r, err := scanParked(rows)
		if err != nil {
			_ = rows.Close()
			return nil, fmt.Errorf("finding parked messages: %w", err)
		}
		out = append(out, r)
	}
	if err := seam.Close(rows); err != nil {
		return nil, fmt.Errorf("finding parked messages: %w", err)
	}
	return out, nil
}

// CountParked counts the parked messages that match f; with f.MaxCount, it
// counts at most MaxCount+1 of them and refuses a count over MaxCount
// (f.CountTooBroad). f must be valid.
func (s *Store) CountParked(ctx context.Context, db wsql.ContextExecutor, f parked.Filter) (int64, error) {
	var where string
	var args []any
	var err error
	t := s.rt.countParked
	if f.MaxCount > 0 {
		t = s.rt.countParkedMax
		where, args, err = s.filterArgs(f, nil, f.MaxCount+1)
	} else {
		where, err = s.parkedWhere(f, nil, &args)
	}
	if err != nil {
		return 0, err
	}
	q := t.Fill(where)
	var n int64
	if err := seam.QueryRow(ctx, db, q, args, &n); err != nil {
		return 0, fmt.Errorf("counting parked messages: %w", err)
	}
	if f.MaxCount > 0 && n > int64(f.MaxCount) {
		return 0, f.CountTooBroad()
	}
	return n, nil
}

// BoundedScan, in tx (REPEATABLE READ, read-only: the check and the read
// see the same messages), refuses (f.TooBroad) a find or count of f, a
// filter that Scans with MaxScan, whose indexed conditions (f.Indexed)
// select more than f.MaxScan parked messages, counting them up to
// MaxScan+1 on the indexes alone; then it sets the planner, for the rest
// of tx, to read the messages of f through the bitmaps of the indexes that
// serve those conditions (a bitmap heap scan reads the rows they select in
// the table's order and checks the other conditions on them), not by a
// sequential scan of the table nor a walk of an index in its order (a
// random read per row): so that the read's work is the rows the check
// counted, whatever the planner estimates. Measured on 1,000,000 parked
// messages (1.3 GB, a loaded development machine), a reason within one
// consumer's 5,500 messages of three days: 15 ms through the bitmap,
// 124 ms by the walk of parked_at the planner chose, 1.1 s by its
// sequential scan for the consumer alone. The check itself may not use a
// sequential scan either (a selective range would read the whole table)
// and reads at most MaxScan+1 index entries: about 2 ms. JIT is off: the
// excluded plans' costs would price these queries for it. f must be valid.
func (s *Store) BoundedScan(ctx context.Context, tx wsql.Tx, f parked.Filter) error {
	if f.MaxScan <= 0 || !f.Scans() {
		return nil
	}
	var a, b string
	if !s.mysql { // MySQL: no planner settings, the check only
		if err := seam.QueryRow(ctx, tx, s.q.get("BoundedScanPlanner"), nil, &a, &b); err != nil {
			return fmt.Errorf("counting the parked messages a search checks: %w", err)
		}
	}
	where, args, err := s.filterArgs(f.Indexed(), nil, f.MaxScan+1)
	if err != nil {
		return err
	}
	// set_config runs once this statement is planned: the check reads the
	// indexes as it will, the read after it through their bitmaps.
	var n int64
	if err := seam.QueryRow(ctx, tx, s.rt.bounded.Fill(where), args, &n, &a); err != nil {
		return fmt.Errorf("counting the parked messages a search checks: %w", err)
	}
	if n > int64(f.MaxScan) {
		return f.TooBroad()
	}
	return nil
}

// GetParked returns the parked message of (consumer, key) with its
// payload, or an error wrapping ErrNoParkedMessage.
func (s *Store) GetParked(ctx context.Context, db wsql.ContextExecutor, consumer, key string) (ParkedRow, error) {
	return s.getParked(ctx, db, s.q.get("GetParked"), consumer, key)
}

// GetParkedPrefix is GetParked with at most the first maxPayload bytes of
// the payload (Message.PayloadSize is the whole payload's size): the
// database reads and sends only that prefix (substring of the stored
// value; a large payload is stored out of line, and only the chunks of
// the prefix are fetched). maxPayload must not be negative.
func (s *Store) GetParkedPrefix(ctx context.Context, db wsql.ContextExecutor, consumer, key string, maxPayload int) (ParkedRow, error) {
	if maxPayload < 0 {
		return ParkedRow{}, fmt.Errorf("%w: the most bytes of the payload to read is %d: at least 0", parked.ErrInvalid, maxPayload)
	}
	if s.mysql { // the prefix's length comes first in the text
		rs, err := s.queryParked(ctx, db, s.q.get("GetParkedPrefix"), maxPayload, consumer, key)
		return firstParked(rs, err, consumer, key)
	}
	return s.getParked(ctx, db, s.q.get("GetParkedPrefix"), consumer, key, maxPayload)
}

// getParked reads the parked message of (consumer, key) with q, GetParked
// or GetParkedPrefix (its arguments from $3 in args).
func (s *Store) getParked(ctx context.Context, db wsql.ContextExecutor, q, consumer, key string, args ...any) (ParkedRow, error) {
	rs, err := s.queryParked(ctx, db, q, append([]any{consumer, key}, args...)...)
	return firstParked(rs, err, consumer, key)
}

// firstParked is getParked's result: the one row of rs, or
// ErrNoParkedMessage.
func firstParked(rs []ParkedRow, err error, consumer, key string) (ParkedRow, error) {
	if err != nil {
		return ParkedRow{}, err
	}
	if len(rs) == 0 {
		return ParkedRow{}, fmt.Errorf("%w (consumer %q, key %q)", ErrNoParkedMessage, consumer, key)
	}
	return rs[0], nil
}

// LockParked locks, in tx (READ COMMITTED), the inbox record of (consumer,
// key) and then its parked message, and returns the parked message (with
// its payload when payload is true) and the record's status. With f, the parked message must
// still match f (its content may have changed since a look-up: parked
// again). It returns an error wrapping ErrNoParkedMessage when there is
// none (or it no longer matches f).
//
// On the partitioned layout it first takes the key's advisory lock (see
// lockRecord), so that a later UPDATE or DELETE of the record in tx finds
// it where a purge may have moved it.
func (s *Store) LockParked(ctx context.Context, tx wsql.Tx, consumer, key string, f *parked.Filter, payload bool) (ParkedRow, error) {
	if err := s.lockRecord(ctx, tx, consumer, key); err != nil {
		return ParkedRow{}, fmt.Errorf("locking %q for %q: %w", key, consumer, err)
	}
	var status string
	err := seam.QueryRow(ctx, tx, s.q.get("LockRecordStatus"), []any{consumer, key}, &status)
	if err != nil && !notFound(err) {
		return ParkedRow{}, fmt.Errorf("locking %q for %q: %w", key, consumer, err)
	}
	args := []any{consumer, key}
	where := "true"
	if f != nil {
		if where, err = s.parkedWhere(*f, nil, &args); err != nil {
			return ParkedRow{}, err
		}
	}
	// The record's status was read above, under its lock: the join is not
	// needed again (and FOR UPDATE cannot lock the nullable side of a LEFT
	// JOIN).
	rs, err := s.queryParked(ctx, tx, s.rt.lockParked[b2i(payload)].Fill(where), args...)
	if err != nil {
		return ParkedRow{}, err
	}
	if len(rs) == 0 {
		return ParkedRow{}, fmt.Errorf("%w (consumer %q, key %q)", ErrNoParkedMessage, consumer, key)
	}
	rs[0].Status = status
	return rs[0], nil
}

// LockRecord locks, in tx (READ COMMITTED), the inbox record of (consumer,
// key) and then its parked message, and returns the record and the UUID of
// the parked message ("" when it has none); found is false when the key
// has no record. It takes the locks of LockParked, in its order.
func (s *Store) LockRecord(ctx context.Context, tx wsql.Tx, consumer, key string) (rec Record, messageUUID string, found bool, err error) {
	if err := s.lockRecord(ctx, tx, consumer, key); err != nil {
		return Record{}, "", false, fmt.Errorf("locking %q for %q: %w", key, consumer, err)
	}
	err = seam.QueryRow(ctx, tx, s.q.get("LockRecord"), []any{consumer, key}, rec.scanDest()...)
	switch {
	case err == nil:
		found = true
	case !notFound(err):
		return Record{}, "", false, fmt.Errorf("locking %q for %q: %w", key, consumer, err)
	}
	err = seam.QueryRow(ctx, tx, s.q.get("LockParkedUUID"), []any{consumer, key}, &messageUUID)
	if err != nil && !notFound(err) {
		return Record{}, "", false, fmt.Errorf("locking the parked message of %q for %q: %w", key, consumer, err)
	}
	return rec, messageUUID, found, nil
}

// DiscardTx deletes, in tx, the parked message of (consumer, key) and marks
// a parked record discarded (a failed, done or processing one keeps its
// status: released, processed since, or held by an attempt); it reports
// whether there was a parked message. Lock the key first (LockParked), so
// that the record is locked before the message.
func (s *Store) DiscardTx(ctx context.Context, tx wsql.Tx, consumer, key string) (bool, error) {
	if s.mysql {
		return s.discardMySQL(ctx, tx, consumer, key)
	}
	var found bool
	err := seam.QueryRow(ctx, tx, s.q.get("Discard"), []any{consumer, key}, &found)
	if err != nil {
		return false, fmt.Errorf("discarding the parked message of %q for %q: %w", key, consumer, err)
	}
	return found, nil
}

// DeleteParked deletes the parked message of (consumer, key) and reports
// whether there was one.
func (s *Store) DeleteParked(ctx context.Context, db wsql.ContextExecutor, consumer, key string) (bool, error) {
	n, err := seam.Exec(ctx, db, s.q.get("DeleteParked"), consumer, key)
	if err != nil {
		return false, fmt.Errorf("deleting the parked message of %q for %q: %w", key, consumer, err)
	}
	return n > 0, nil
}

// ForgetTx deletes, in tx, the inbox record of (consumer, key) and then its
// parked message, and reports whether each existed. On the partitioned
// layout it first takes the key's advisory lock (see lockRecord).
func (s *Store) ForgetTx(ctx context.Context, tx wsql.Tx, consumer, key string) (record, message bool, err error) {
	if err := s.lockRecord(ctx, tx, consumer, key); err != nil {
		return false, false, fmt.Errorf("forget %q for %q: %w", key, consumer, err)
	}
	return s.forget(ctx, tx, consumer, key, false)
}

// DiscardForgetTx deletes, in tx, the parked message of (consumer, key) and
// forgets the key's record only while it still waits for an operator
// (parked, or failed: released): a record done (its message processed
// since) or processing (an attempt holds it) stays, or a later copy would
// run the handler again. It reports whether a parked message existed.
func (s *Store) DiscardForgetTx(ctx context.Context, tx wsql.Tx, consumer, key string) (bool, error) {
	if err := s.lockRecord(ctx, tx, consumer, key); err != nil {
		return false, fmt.Errorf("discard %q for %q: %w", key, consumer, err)
	}
	_, message, err := s.forget(ctx, tx, consumer, key, true)
	return message, err
}

// DiscardParkedBatch deletes, in tx, up to limit parked messages that
// match f (oldest first, skipping those another transaction holds: being
// replayed or discarded), and returns the number of parked messages
// deleted. Their keys' records that are parked become discarded, or, when
// forget is true, the records that still wait for an operator (parked,
// failed) are deleted. f must be valid.
//
// The parked messages are locked before the records, the other way round
// from a replay of the same key: the two may deadlock, which PostgreSQL
// detects (40P01); run the batch again.
func (s *Store) DiscardParkedBatch(ctx context.Context, tx wsql.Tx, f parked.Filter, limit int, forget bool) (int64, error) {
	// Without forget, the records that are parked become discarded; with
	// it, only records that still wait for an operator are deleted: a done
	// one (its message processed since) or a processing one stays.
	where, args, err := s.filterArgs(f, nil, limit)
	if err != nil {
		return 0, err
	}
	if s.mysql {
		n, err := s.discardParkedBatchMySQL(ctx, tx, where, args, forget)
		if err != nil {
			return 0, fmt.Errorf("discarding parked messages: %w", err)
		}
		return n, nil
	}
	q := s.rt.discardBatch[b2i(forget)].Fill(where)
	var n int64
	if err := seam.QueryRow(ctx, tx, q, args, &n); err != nil {
		return 0, fmt.Errorf("discarding parked messages: %w", err)
	}
	return n, nil
}
