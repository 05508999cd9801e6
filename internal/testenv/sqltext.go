package testenv

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

// placeholder is a PostgreSQL positional parameter ($1, $2, ...).
var placeholder = regexp.MustCompile(`\$[0-9]+`)

// Q returns query, a test's own statement written for PostgreSQL, in the
// bundle's dialect: on MySQL its placeholders $1, $2, ... become ?. They
// must appear in order, each once (?-placeholders are positional); Q
// panics otherwise, since such a statement needs its MySQL text written
// out (b.SQL). Q changes nothing else: quote table names with b.Table, and
// give statements whose text differs otherwise (now(), ::casts, RETURNING)
// through b.SQL.
func (b *Bundle) Q(query string) string {
	if !b.MySQL() {
		return query
	}
	return MySQLPlaceholders(query)
}

// MySQLPlaceholders rewrites the placeholders $1, $2, ... of query, which
// appear in that order and each once, to ?; it panics when they do not.
func MySQLPlaceholders(query string) string {
	next := 1
	return placeholder.ReplaceAllStringFunc(query, func(p string) string {
		n, err := strconv.Atoi(p[1:])
		if err != nil || n != next {
			panic(fmt.Sprintf("testenv: placeholder %s out of order in %q (want $%d): write the MySQL text with Bundle.SQL", p, query, next))
		}
		next++
		return "?"
	})
}

// KeyText is the column type of a test's own text column that is a
// PRIMARY KEY or UNIQUE: text on PostgreSQL, VARCHAR(255) on MySQL (which
// indexes no TEXT column without a prefix length).
func (b *Bundle) KeyText() string { return b.SQL("text", "VARCHAR(255)") }

// lockWaiters counts the InnoDB transactions waiting on a lock whose
// statement is LIKE its parameter.
const lockWaiters = "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE ?"

// longStatements counts the other sessions whose statement, LIKE its
// parameter, has run for 200ms or more (MariaDB's processlist.time_ms):
// information_schema.processlist is read live, innodb_trx from a cache.
const longStatements = "SELECT count(*) FROM information_schema.processlist WHERE command IN ('Query', 'Execute') AND time_ms >= 200 AND info LIKE ? AND id <> connection_id()"

// WaitForLockWaiter waits (up to 10s) until a MySQL transaction whose
// statement mentions the bundle's database waits on a lock: a delivery
// under test is blocked behind a transaction the test holds open. MariaDB
// only. It asks information_schema.innodb_trx (trx_state 'LOCK WAIT'),
// which InnoDB serves from a cache it refreshes only when more than 0.1s
// passed since it was last read: it polls slower than that, but anything
// else on the server that reads the table more often (another test, a
// monitoring agent) keeps the snapshot stale. So a statement of the
// database that has run for 200ms (the live processlist) counts too.
func (b *Bundle) WaitForLockWaiter(t testing.TB) {
	t.Helper()
	require.True(t, b.MySQL(), "WaitForLockWaiter is MySQL's")
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		var n int64
		like := "%" + b.DB.Schema + "%"
		err := seam.QueryRow(ctx, b.Driver.DB, lockWaiters, []any{like}, &n)
		var long int64
		if err == nil {
			err = seam.QueryRow(ctx, b.Driver.DB, longStatements, []any{like}, &long)
		}
		cancel()
		if err == nil && n+long > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Logf("the server's sessions: %s", b.processList())
			t.Fatalf("no transaction of the test's database waited on a lock within 10s (last error: %v)", err)
		}
		time.Sleep(innoDBTrxRefresh)
	}
}

// innoDBTrxRefresh is longer than the 0.1s for which InnoDB serves its
// information_schema transaction and lock tables from one snapshot.
const innoDBTrxRefresh = 150 * time.Millisecond

// processList describes the server's sessions of the bundle's database
// (information_schema.processlist), for a failure message.
func (b *Bundle) processList() string {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	rows, err := b.Driver.DB.QueryContext(ctx, "SELECT id, command, COALESCE(state, ''), COALESCE(info, '') FROM information_schema.processlist WHERE db = ? OR info LIKE ?", b.DB.Schema, "%"+b.DB.Schema+"%")
	if err != nil {
		return err.Error()
	}
	defer func() { _ = rows.Close() }()
	var out strings.Builder
	for rows.Next() {
		var id int64
		var command, state, info string
		if err := rows.Scan(&id, &command, &state, &info); err != nil {
			return err.Error()
		}
		fmt.Fprintf(&out, "\n  %d %s [%s] %s", id, command, state, info)
	}
	return out.String()
}
