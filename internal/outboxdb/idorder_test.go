package outboxdb_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/outboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// IDOrder, MySQL's start-up check of the ids' order: a migrated table
// passes; a table whose ids or key locks would not follow the commits
// (another engine than InnoDB, no key-lock table, an id column that is
// not AUTO_INCREMENT) fails, saying why; a missing table is ErrNoTable.
// (auto_increment_increment is the server's: idOrderVerdict's test.)
func TestIDOrderMySQL(t *testing.T) {
	t.Parallel()
	b := testenv.NewBundle(t, testenv.DriverNamed(t, testenv.MariaDB))
	s, err := outboxdb.New(b.DB)
	require.NoError(t, err)
	q := b.Driver.DB
	keyLocks := b.Table(b.DB.OutboxTable + "_key_locks")
	check := func() (bool, string) {
		t.Helper()
		ok, why, err := s.IDOrder(b.Ctx, q)
		require.NoError(t, err)
		return ok, why
	}

	ok, why := check()
	require.True(t, ok, why)
	require.Empty(t, why)

	b.Exec(t, "ALTER TABLE "+keyLocks+" ENGINE = MyISAM")
	ok, why = check()
	require.False(t, ok)
	require.Contains(t, why, "the key-lock table's engine is MyISAM, not InnoDB")

	b.Exec(t, "DROP TABLE "+keyLocks)
	b.Exec(t, "ALTER TABLE "+b.DB.Outbox()+" MODIFY id BIGINT NOT NULL")
	ok, why = check()
	require.False(t, ok)
	require.Contains(t, why, "(<outbox>_key_locks) does not exist")
	require.Contains(t, why, "id column is not AUTO_INCREMENT")

	b.Exec(t, "ALTER TABLE "+b.DB.Outbox()+" ENGINE = Aria")
	ok, why = check()
	require.False(t, ok)
	require.Contains(t, why, "the outbox table's engine is Aria, not InnoDB")

	b.Exec(t, "DROP TABLE "+b.DB.Outbox())
	_, _, err = s.IDOrder(b.Ctx, q)
	require.ErrorIs(t, err, outboxdb.ErrNoTable)
}

// On PostgreSQL the id order is IDSequence's check: IDOrder passes.
func TestIDOrderPostgres(t *testing.T) {
	t.Parallel()
	db := testenv.Schema(t)
	s, err := outboxdb.New(db)
	require.NoError(t, err)
	ok, why, err := s.IDOrder(t.Context(), db.Conn)
	require.NoError(t, err)
	require.True(t, ok, why)
}
