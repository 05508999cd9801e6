package inboxdb_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// A session's prepared claim follows the table by its name: a table
// renamed into place (another table, the same name) takes the next claim
// of a connection that prepared the statement over the former one, and a
// column added since does not break it.
func TestBeginClaimPgxPreparedTableRenamedIntoPlace(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tables := testenv.Schema(t)
	s, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
	require.NoError(t, err)
	pool := poolWithMode(t, testenv.DirectDatabaseURL(), pgx.QueryExecModeCacheStatement, 1)
	conn, err := pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	c := conn.Conn()

	claimCommit(ctx, t, s, c, "c", "k1")
	stmts, _ := sessionStatements(ctx, t, c)
	require.Contains(t, stmts, s.PreparedClaimName())

	admin, err := pgx.Connect(ctx, testenv.DirectDatabaseURL())
	require.NoError(t, err)
	defer func() { _ = admin.Close(ctx) }()
	oldName := pgx.Identifier{tables.Schema, tables.InboxTable + "_old"}.Sanitize()
	_, err = admin.Exec(ctx, `ALTER TABLE `+s.Table()+` RENAME TO `+pgx.Identifier{tables.InboxTable + "_old"}.Sanitize())
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `CREATE TABLE `+s.Table()+` (LIKE `+oldName+` INCLUDING ALL)`)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `ALTER TABLE `+s.Table()+` ADD COLUMN extra_adversary text NOT NULL DEFAULT 'x'`)
	require.NoError(t, err)

	// k1 is in the former table only: the table in place claims it.
	claimCommit(ctx, t, s, c, "c", "k1")
	tx, res, err := s.BeginClaimPgx(ctx, c, "c", "k1")
	require.NoError(t, err)
	require.Nil(t, tx)
	require.False(t, res.Claimed)
	require.Equal(t, int64(1), res.Existing.Duplicates)
	var n, dups int64
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*), coalesce(sum(duplicates), 0) FROM `+oldName).Scan(&n, &dups))
	require.Equal(t, int64(1), n)
	require.Equal(t, int64(0), dups, "the former table is left alone")
	require.NoError(t, admin.QueryRow(ctx, `SELECT count(*) FROM `+s.Table()).Scan(&n))
	require.Equal(t, int64(1), n)
	require.False(t, s.PreparedClaimOff())
}

// A claim whose context ends while its connection prepares the statement
// (or runs BEGIN; EXECUTE) writes nothing, and neither loses the key nor
// turns the store literal: the next claims on the pool's connections, the
// one that was interrupted included when it survived, claim the key once.
func TestBeginClaimPgxPreparedContextEnds(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	tables := testenv.Schema(t)
	s, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
	require.NoError(t, err)
	pool := poolWithMode(t, testenv.DirectDatabaseURL(), pgx.QueryExecModeCacheStatement, 2)
	for i := range 40 {
		cctx, ccancel := context.WithTimeout(ctx, time.Duration(i*25)*time.Microsecond)
		tx, res, err := s.BeginClaimPool(cctx, pool, "c", "k")
		if err == nil && res.Claimed {
			_ = tx.Rollback()
		}
		ccancel()
	}
	require.False(t, s.PreparedClaimOff(), "an interrupted PREPARE is not a pooler")
	tx, res, err := s.BeginClaimPool(ctx, pool, "c", "k")
	require.NoError(t, err)
	require.True(t, res.Claimed)
	require.NoError(t, tx.Commit())
	tx, res, err = s.BeginClaimPool(ctx, pool, "c", "k")
	require.NoError(t, err)
	require.Nil(t, tx)
	require.False(t, res.Claimed)
	var n int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM `+s.Table()).Scan(&n))
	require.Equal(t, int64(1), n)
}
