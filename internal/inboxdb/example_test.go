package inboxdb_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// ClaimTx in the transaction that also holds the handler's writes: the first
// delivery of a key is claimed, every redelivery is a duplicate.
func ExampleStore_ClaimTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.DatabaseURL())
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	db := wsql.BeginnerFromPgx(pool)

	suffix := make([]byte, 4)
	_, _ = rand.Read(suffix)
	tables := sqlschema.DB{Conn: db, Schema: "example_inbox_" + hex.EncodeToString(suffix)}
	defer func() {
		_, _ = pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{tables.Schema}.Sanitize()+" CASCADE")
	}()
	if err := sqlschema.Migrate(ctx, tables); err != nil {
		fmt.Println(err)
		return
	}
	store, err := inboxdb.NewStore(inboxdb.Config{Tables: tables})
	if err != nil {
		fmt.Println(err)
		return
	}

	for delivery := 1; delivery <= 3; delivery++ {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			fmt.Println(err)
			return
		}
		res, err := store.ClaimTx(ctx, tx, "send-sms", "order-42")
		if err != nil {
			_ = tx.Rollback()
			fmt.Println(err)
			return
		}
		if res.Claimed {
			fmt.Printf("delivery %d: claimed, run the handler\n", delivery)
			// ... the handler's writes go through tx here ...
		} else {
			fmt.Printf("delivery %d: duplicate #%d, skip the handler\n", delivery, res.Existing.Duplicates)
		}
		if err := tx.Commit(); err != nil {
			fmt.Println(err)
			return
		}
	}

	st, err := store.Stats(ctx, db, "send-sms")
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("records: %d, duplicates: %d\n", st.Total, st.Duplicates)
	// Output:
	// delivery 1: claimed, run the handler
	// delivery 2: duplicate #1, skip the handler
	// delivery 3: duplicate #2, skip the handler
	// records: 1, duplicates: 2
}
