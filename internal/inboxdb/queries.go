package inboxdb

import (
	"embed"
	"fmt"
	"io/fs"
	"sort"
	"strings"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxpart"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlexec"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlfile"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// queryFiles are the store's statements, one directory per dialect
// (queries/postgres, queries/mysql), each with:
//
//   - *.sql: the statements of both layouts;
//   - plain/*.sql: those of the plain layout only (ON CONFLICT on the
//     primary key (consumer, message_key), the pgx fast path's INSERT);
//   - partitioned/*.sql: those of the partitioned layout only;
//   - placed/*.sql: those of the partitioned layout that write a new
//     record, or lock for one, each rendered twice: as written (a write at
//     clock_timestamp()) and, under its name with "Fallback", with
//     .Fallback true (a fallback write, see placement);
//   - fragments/*.sql: pieces the other files use, as .Frag.<Name>
//     (rendered first).
//
//go:embed queries
var queryFiles embed.FS

// queryDir is the directory of a dialect's statements: queries/postgres,
// queries/mysql.
func queryDir(d sqlschema.Dialect) string { return "queries/" + d.String() }

// fallbackSuffix names the fallback-write rendering of a partitioned
// statement.
const fallbackSuffix = "Fallback"

// queryData is what the statements see when they are rendered, once per
// table set (NewStore).
type queryData struct {
	// Inbox and Parked are the quoted, schema-qualified tables.
	Inbox, Parked string
	// ClaimFunc, ClaimBatchFunc and DuplicateFunc are the partitioned
	// layout's claim functions (migration inbox_002), schema-qualified.
	ClaimFunc, ClaimBatchFunc, DuplicateFunc string
	// IsolationMarker starts the error a partitioned claim raises outside
	// READ COMMITTED.
	IsolationMarker string
	// The advisory lock classes of the two-key space (lockPlan).
	FallbackLockClass, PurgeLockClass int
	// Partitioned is the layout; Fallback is set for the fallback
	// rendering of a partitioned statement.
	Partitioned, Fallback bool
	// The partitioned layout's partition names, for NewestEnd: their
	// prefix (<table>_p), the digits after it, the SQL of the hour they
	// start at, their interval (empty for the plain layout).
	PartPrefix, PartDigits, PartHour, PartStep string
	PartPrefixLen                              int
	// Frag is the fragments (fragments/*.sql), by name; nil while the
	// fragments themselves are rendered.
	Frag map[string]string
}

// LockKey is the SQL expression of the per-key advisory lock key of
// (consumer, key), SQL expressions of type text (inboxpart.LockKey: the
// one definition the claim functions share).
func (d queryData) LockKey(consumer, key string) string {
	return inboxpart.LockKey(d.Inbox, consumer, key)
}

// Run marks a field filled at run time (a sqlexec.Template's hole).
func (d queryData) Run(name string) string { return sqlexec.Hole(name) }

// queries are the store's statements for its table set, by name.
type queries struct {
	byName map[string]string
}

// get returns the statement called name. It panics when no file defines
// it: a programming error of the store, found by its tests
// (TestQueriesPrepare prepares every statement of every layout).
func (q queries) get(name string) string {
	text, ok := q.byName[name]
	if !ok {
		panic("inboxdb: no statement named " + name)
	}
	return text
}

// names lists the statements, sorted.
func (q queries) names() []string {
	out := make([]string, 0, len(q.byName))
	for n := range q.byName {
		out = append(out, n)
	}
	sort.Strings(out)
	return out
}

func newQueryData(cfg Config) queryData {
	t := cfg.Tables
	fn := func(suffix string) string { return t.Dialect.QuoteIdentifier(t.Schema, t.InboxTable+"_"+suffix) }
	d := queryData{
		Inbox:     t.Inbox(),
		Parked:    fn("parked"),
		ClaimFunc: fn("claim"), ClaimBatchFunc: fn("claim_batch"), DuplicateFunc: fn("duplicate"),
		IsolationMarker:   inboxpart.IsolationMarker,
		FallbackLockClass: fallbackLockClass, PurgeLockClass: purgeLockClass,
		Partitioned: t.Partitions != nil,
	}
	if d.Partitioned {
		d.PartPrefix = t.InboxTable + "_p"
		d.PartPrefixLen = len(d.PartPrefix)
		d.PartDigits, d.PartHour, d.PartStep = "8", "0", "1 day"
		if t.Partitions.WithDefaults().Interval == sqlschema.Hourly {
			d.PartDigits, d.PartHour, d.PartStep = "10", "substr(n.d, 9, 2)::int", "1 hour"
		}
	}
	return d
}

// loadQueries renders the statements of cfg's table set.
func loadQueries(cfg Config) (queries, error) {
	d := newQueryData(cfg)
	queryDir := queryDir(cfg.Tables.Dialect)
	out := map[string]string{}
	add := func(dir string, data queryData, suffix string, out map[string]string) error {
		files, err := fs.Glob(queryFiles, dir+"/*.sql")
		if err != nil {
			return err
		}
		sort.Strings(files)
		for _, f := range files {
			src, err := fs.ReadFile(queryFiles, f)
			if err != nil {
				return err
			}
			parsed, err := sqlfile.Parse(src)
			if err != nil {
				return fmt.Errorf("%s: %w", f, err)
			}
			for _, st := range parsed {
				text, err := sqlfile.Execute(st, data)
				if err != nil {
					return fmt.Errorf("%s: %w", f, err)
				}
				name := st.Name + suffix
				if _, dup := out[name]; dup {
					return fmt.Errorf("%s: statement %q is defined twice", f, name)
				}
				out[name] = strings.TrimSpace(text)
			}
		}
		return nil
	}
	frag := map[string]string{}
	if err := add(queryDir+"/fragments", d, "", frag); err != nil {
		return queries{}, err
	}
	d.Frag = frag
	if err := add(queryDir, d, "", out); err != nil {
		return queries{}, err
	}
	if d.Partitioned {
		if err := add(queryDir+"/partitioned", d, "", out); err != nil {
			return queries{}, err
		}
		if err := add(queryDir+"/placed", d, "", out); err != nil {
			return queries{}, err
		}
		fb := d
		fb.Fallback = true
		if err := add(queryDir+"/placed", fb, fallbackSuffix, out); err != nil {
			return queries{}, err
		}
	} else if err := add(queryDir+"/plain", d, "", out); err != nil {
		return queries{}, err
	}
	return queries{byName: out}, nil
}

// runTemplates are the store's run-time templates (see the package
// documentation), split once at their holes.
type runTemplates struct {
	// The plain layout's pgx fast path.
	beginLiteral, prepare, beginExecute sqlexec.Template
	// The partitioned layout's pgx fast path: the lock statement (by
	// placement: [0] at now, [1] a fallback write) and the claim
	// functions' calls.
	beginLock                                       [2]sqlexec.Template
	beginFunc, duplicateFunc, rollbackDuplicateFunc sqlexec.Template
	// The partitioned layout's retention: statements naming a partition.
	detach, finalize, drop, attach, countKeptAfter, countOpen sqlexec.Template
	// MySQL's batch claim: the multi-row INSERT (Rows: ClaimBatchRow per
	// key), the locking read of the batch and the fix of its own records'
	// counts (Keys: a placeholder per key).
	claimBatchInsert, claimBatchLock sqlexec.Template
	// A parked-message filter's statements: [keysFirst][payloads] for the
	// find, [payload] for the lock, [forget] for the batch discard.
	findParked                           [2][2]sqlexec.Template
	countParked, countParkedMax, bounded sqlexec.Template
	lockParked                           [2]sqlexec.Template
	discardBatch                         [2]sqlexec.Template
}

func newRunTemplates(q queries, partitioned, mysql bool) (runTemplates, error) {
	var rt runTemplates
	var err error
	tm := func(dst *sqlexec.Template, name string, holes ...string) {
		if err != nil {
			return
		}
		*dst, err = sqlexec.NewTemplate(q.get(name), holes...)
		if err != nil {
			err = fmt.Errorf("statement %s: %w", name, err)
		}
	}
	switch {
	case mysql:
		// No pgx fast path, no partitioned layout (refused by sqlschema).
		tm(&rt.claimBatchInsert, "ClaimBatchInsert", "Rows")
		tm(&rt.claimBatchLock, "ClaimBatchLock", "Reads")
	case partitioned:
		tm(&rt.beginLock[0], "BeginClaimLock", "Consumer", "Key")
		tm(&rt.beginLock[1], "BeginClaimLock"+fallbackSuffix, "Consumer", "Key")
		tm(&rt.beginFunc, "BeginClaimFunc", "Consumer", "Key")
		tm(&rt.duplicateFunc, "DuplicateFuncCall", "Consumer", "Key")
		tm(&rt.rollbackDuplicateFunc, "RollbackDuplicateFuncCall", "Consumer", "Key")
		tm(&rt.detach, "DetachConcurrently", "Partition")
		tm(&rt.finalize, "DetachFinalize", "Partition")
		tm(&rt.drop, "DropDetached", "Partition")
		tm(&rt.attach, "AttachAgain", "Partition", "From", "To")
		tm(&rt.countKeptAfter, "CountDetachedAfter", "Partition")
		tm(&rt.countOpen, "CountDetachedOpen", "Partition")
	default:
		tm(&rt.beginLiteral, "BeginClaimLiteral", "Consumer", "Key")
		tm(&rt.prepare, "ClaimPrepare", "Name")
		tm(&rt.beginExecute, "BeginClaimExecute", "Name", "Consumer", "Key")
	}
	tm(&rt.findParked[0][0], "FindParked", "Where")
	tm(&rt.findParked[0][1], "FindParkedPayloads", "Where")
	tm(&rt.findParked[1][0], "FindParkedKeysFirst", "Where")
	tm(&rt.findParked[1][1], "FindParkedKeysFirstPayloads", "Where")
	tm(&rt.countParked, "CountParked", "Where")
	tm(&rt.countParkedMax, "CountParkedMax", "Where")
	tm(&rt.bounded, "BoundedScanCount", "Where")
	tm(&rt.lockParked[0], "LockParkedMessage", "Where")
	tm(&rt.lockParked[1], "LockParkedMessagePayload", "Where")
	tm(&rt.discardBatch[0], "DiscardParkedBatch", "Where")
	if !mysql { // MySQL's pick serves both (discardParkedBatchMySQL)
		tm(&rt.discardBatch[1], "DiscardForgetParkedBatch", "Where")
	}
	return rt, err
}

// b2i is 1 for true: the index of a run-time template's variant.
func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// Statement returns the text of the store's statement called name (see
// queries/postgres, queries/mysql), rendered for its table set: for tests that check a
// statement's plan. It panics for a name no file defines.
func (s *Store) Statement(name string) string { return s.q.get(name) }
