package sqlexec

import (
	stdsql "database/sql"
	"testing"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/assert"
)

// The classification is pure: values that are never connected.
func TestOf(t *testing.T) {
	pool := &pgxpool.Pool{}
	d := Of(wsql.BeginnerFromPgx(pool))
	assert.Equal(t, Pgx, d.Kind())
	p, ok := d.PgxPool()
	assert.True(t, ok)
	assert.Same(t, pool, p)
	_, ok = d.StdDB()
	assert.False(t, ok)

	conn := &pgx.Conn{}
	d = Of(wsql.BeginnerFromPgx(conn))
	assert.Equal(t, Pgx, d.Kind())
	_, ok = d.PgxPool()
	assert.False(t, ok, "a connection is not a pool")

	db := &stdsql.DB{}
	for _, d := range []DB{Of(wsql.BeginnerFromStdSQL(db)), OfStd(db)} {
		assert.Equal(t, Std, d.Kind())
		got, ok := d.StdDB()
		assert.True(t, ok)
		assert.Same(t, db, got)
		_, ok = d.PgxPool()
		assert.False(t, ok)
	}

	d = Of(nil)
	assert.Equal(t, Other, d.Kind())
	assert.Equal(t, "other", d.Kind().String())
}

type fakeTx struct{ wsql.Tx }

func TestTxOf(t *testing.T) {
	std := &stdsql.Tx{}
	for _, in := range []wsql.Tx{wsql.TxFromStdSQL(std), &wsql.StdSQLTx{Tx: std}} {
		x := TxOf(in)
		assert.Equal(t, Std, x.Kind())
		got, ok := x.StdTx()
		assert.True(t, ok)
		assert.Same(t, std, got)
		_, ok = x.Pgx()
		assert.False(t, ok)
		assert.Equal(t, x, TxOf(x), "a classified Tx passes through")
	}

	x := TxOf(fakeTx{})
	assert.Equal(t, Other, x.Kind())
	_, ok := x.Pgx()
	assert.False(t, ok)
	_, ok = x.StdTx()
	assert.False(t, ok)

	x = TxOf(wsql.PgxTx{})
	assert.Equal(t, Other, x.Kind(), "a pgx Tx without its transaction")
	x = TxOf(&PoolTx{})
	assert.Equal(t, Other, x.Kind())
}

func TestTemplate(t *testing.T) {
	tm, err := NewTemplate("ALTER TABLE t ATTACH PARTITION "+Hole("P")+" FOR VALUES FROM ("+Hole("From")+") TO ("+Hole("To")+") -- "+Hole("P"), "P", "From", "To")
	assert.NoError(t, err)
	assert.Equal(t, "ALTER TABLE t ATTACH PARTITION p1 FOR VALUES FROM (a) TO (b) -- p1", tm.Fill("p1", "a", "b"))
	assert.Equal(t, "ALTER TABLE t ATTACH PARTITION <P> FOR VALUES FROM (<From>) TO (<To>) -- <P>", tm.Sample())
	assert.Panics(t, func() { tm.Fill("p1") })

	_, err = NewTemplate("SELECT "+Hole("A"), "B")
	assert.ErrorContains(t, err, "run-time holes [A], want [B]")
	_, err = NewTemplate("SELECT \x00A", "A")
	assert.ErrorContains(t, err, "unclosed")
	tm, err = NewTemplate("SELECT 1")
	assert.NoError(t, err)
	assert.Equal(t, "SELECT 1", tm.Fill())
}
