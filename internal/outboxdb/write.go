package outboxdb

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"text/template"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/sqlfile"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// keyLocksSuffix makes the name of MySQL's table of the ordering keys'
// locks from the outbox table's (sqlschema's OutboxKeyLocks).
const keyLocksSuffix = "_key_locks"

// parsePerCount parses the statements of dir's write.sql that are
// rendered per call (perCountStatements), when they use .Rows: none on
// PostgreSQL, whose statements take arrays.
func parsePerCount(dir string) (map[string]*template.Template, error) {
	src, err := queries.ReadFile(dir + "/write.sql")
	if err != nil {
		return nil, err
	}
	parsed, err := sqlfile.Parse(src)
	if err != nil {
		return nil, fmt.Errorf("sqlfile: write.sql: %w", err)
	}
	out := map[string]*template.Template{}
	for _, st := range parsed {
		if !strings.Contains(st.Text, ".Rows") {
			continue
		}
		t, err := template.New(st.Name).Option("missingkey=error").Parse(st.Text)
		if err != nil {
			return nil, fmt.Errorf("sqlfile: write.sql: statement %q: %w", st.Name, err)
		}
		out[st.Name] = t
	}
	return out, nil
}

// statementFor returns the statement called name for n rows: rendered for
// n when it is one of perCount, else as New rendered it.
func (s *Store) statementFor(name string, n int) (string, error) {
	t, ok := s.perCount[name]
	if !ok {
		return s.st.Get(name), nil
	}
	data := s.data
	data.Rows = n
	var b strings.Builder
	if err := t.Execute(&b, data); err != nil {
		return "", fmt.Errorf("sqlfile: statement %q: %w", name, err)
	}
	return b.String(), nil
}

// Insert is the rows of one INSERT: one message per index of UUIDs,
// Payloads, Metadata and OrderingKeys, in the order their ids are drawn.
type Insert struct {
	Topic        string
	UUIDs        []string
	Payloads     [][]byte // never nil ones: a payload is NOT NULL
	Metadata     []string // JSON objects
	OrderingKeys []string // "" for none
	// LockClass and Locks are the ordering keys' locks, taken, for each k
	// of Locks in that order, before the ids are drawn. On PostgreSQL the
	// transaction-level advisory lock (LockClass, k) (see write.sql's
	// Insert); on MySQL the row k of the table of key locks (LockClass is
	// not used: the table is the outbox's own; see write.sql's LockKeys),
	// which holds the lock until the transaction ends only when q is one:
	// the caller runs Insert in a transaction when Locks is not empty.
	// Locks may be empty.
	LockClass int32
	Locks     []int32
}

// Insert writes the rows; with notify, it also sends the table's NOTIFY.
// On PostgreSQL that is one statement (write.sql's Insert or
// InsertNotify). On MySQL it is two, run on q in this order: the key
// locks (LockKeys, none without Locks), then the multi-row INSERT; notify
// is ignored (MySQL has no NOTIFY).
func (s *Store) Insert(ctx context.Context, q wsql.ContextExecutor, in Insert, notify bool) error {
	if s.db.Dialect == sqlschema.MySQL {
		return s.insertMySQL(ctx, q, in)
	}
	name := "Insert"
	if notify {
		name = "InsertNotify"
	}
	locks := in.Locks
	if locks == nil {
		locks = []int32{}
	}
	_, err := q.ExecContext(ctx, s.st.Get(name), in.Topic, in.UUIDs, in.Payloads, in.Metadata, in.OrderingKeys, in.LockClass, locks)
	return err
}

// insertMySQL is Insert on MySQL: LockKeys, then Insert, each rendered
// for the call's number of rows.
func (s *Store) insertMySQL(ctx context.Context, q wsql.ContextExecutor, in Insert) error {
	n := len(in.UUIDs)
	if n == 0 || len(in.Payloads) != n || len(in.Metadata) != n || len(in.OrderingKeys) != n {
		return errors.New("an insert's columns must have the same, non-zero number of rows")
	}
	if len(in.Locks) > 0 {
		lock, err := s.statementFor("LockKeys", len(in.Locks))
		if err != nil {
			return err
		}
		args := make([]any, len(in.Locks))
		for i, k := range in.Locks {
			args[i] = k
		}
		if _, err := q.ExecContext(ctx, lock, args...); err != nil {
			return err
		}
	}
	insert, err := s.statementFor("Insert", n)
	if err != nil {
		return err
	}
	args := make([]any, 0, 5*n)
	for i := range n {
		args = append(args, in.Topic, in.UUIDs[i], in.Payloads[i], in.Metadata[i], in.OrderingKeys[i])
	}
	_, err = q.ExecContext(ctx, insert, args...)
	return err
}

// CanNotify reports whether the dialect has a NOTIFY (PostgreSQL): on
// MySQL Insert ignores its notify, and Notify sends nothing.
func (s *Store) CanNotify() bool { return s.db.Dialect != sqlschema.MySQL }

// Notify sends the table's NOTIFY, delivered when the transaction commits.
// On MySQL, which has none, it does nothing.
func (s *Store) Notify(ctx context.Context, q wsql.ContextExecutor) error {
	if !s.CanNotify() {
		return nil
	}
	_, err := q.ExecContext(ctx, s.st.Get("Notify"))
	return err
}

// IDOrder reports whether the ids that MySQL/MariaDB draws for the outbox
// table follow, for each ordering key, the order in which the key's
// writers committed (the order the relay keeps), as far as the server
// can tell; why says what breaks it when ok is false. It returns
// ErrNoTable when the table does not exist. On PostgreSQL, whose check is
// IDSequence (the sequence's CACHE), it returns true.
//
// Why the order holds on MySQL: a writer of a key first upserts the key's
// row of <outbox>_key_locks (write.sql's LockKeys), whose exclusive InnoDB
// record lock it holds until its transaction ends, and only then inserts
// its messages, whose AUTO_INCREMENT ids it draws at that moment. So a
// second writer of the key draws its ids after the first committed (or
// rolled back), and InnoDB's counter only grows: its ids are larger. What
// this needs, and what is checked:
//
//   - Both tables are InnoDB. Another engine (MyISAM, Aria, MEMORY) has no
//     transactions or row locks: the key lock would end with its
//     statement (and a rollback would leave the rows).
//   - The id column is AUTO_INCREMENT: the ids are drawn by the INSERT,
//     after the lock (a table created by another tool might not be).
//   - @@GLOBAL.auto_increment_increment is 1. A larger increment alone
//     keeps ids growing on one server, but it is the mark of several
//     primaries drawing ids from interleaved series (Galera's
//     wsrep_auto_increment_control, multi-primary group replication,
//     circular replication with auto_increment_offset): a row lock is
//     local to its server, and each primary draws from its own counter,
//     so the writers of a key on two primaries are not serialised, and a
//     later commit can carry a smaller id. The check cannot tell whether
//     the application writes to one primary only (then the order holds).
//
// What is not checked, because it does not break the order:
// innodb_autoinc_lock_mode (0, 1 and 2 all draw from one counter that
// only grows; mode 2 interleaves the ids of concurrent statements, which
// only writers of other keys can be, and those are not ordered anyway),
// the session's auto_increment_offset (with an increment of 1), and the
// counter's persistence across restarts (MySQL 8 and MariaDB 10.2.4+ keep
// it; a counter reset to MAX(id)+1 would still exceed every pending row).
func (s *Store) IDOrder(ctx context.Context, q wsql.ContextExecutor) (ok bool, why string, err error) {
	if s.db.Dialect != sqlschema.MySQL {
		return true, "", nil
	}
	var (
		engine, lockEngine string
		autoIncrement      bool
		increment          int64
	)
	err = seam.QueryRow(ctx, q, s.st.Get("IDOrder"),
		[]any{s.db.OutboxTable + keyLocksSuffix, s.db.Schema, s.db.OutboxTable},
		&engine, &lockEngine, &autoIncrement, &increment)
	if errors.Is(err, seam.ErrNoRows) {
		return false, "", ErrNoTable
	}
	if err != nil {
		return false, "", err
	}
	return idOrderVerdict(engine, lockEngine, autoIncrement, increment)
}

// idOrderVerdict is IDOrder's verdict on what the catalog says.
func idOrderVerdict(engine, lockEngine string, autoIncrement bool, increment int64) (bool, string, error) {
	var why []string
	if !strings.EqualFold(engine, "InnoDB") {
		why = append(why, fmt.Sprintf("the outbox table's engine is %s, not InnoDB: its writes are not transactional and take no row locks", engine))
	}
	switch {
	case lockEngine == "":
		why = append(why, "the outbox's key-lock table (<outbox>"+keyLocksSuffix+") does not exist: run the outbox's migrations")
	case !strings.EqualFold(lockEngine, "InnoDB"):
		why = append(why, fmt.Sprintf("the key-lock table's engine is %s, not InnoDB: a key's lock ends with its statement, not its transaction", lockEngine))
	}
	if !autoIncrement {
		why = append(why, "the outbox table's id column is not AUTO_INCREMENT: its ids are not drawn by the INSERT, after the key's lock")
	}
	if increment != 1 {
		why = append(why, fmt.Sprintf("auto_increment_increment is %d: several primaries draw ids (Galera, multi-primary or circular replication), and the writers of a key on two of them are not serialised, so a later commit can carry a smaller id (write to one primary only)", increment))
	}
	return len(why) == 0, strings.Join(why, "; "), nil
}
