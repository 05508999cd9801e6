package exactlyonce_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// The pgx fast path of transactional mode on a pool straight to PostgreSQL
// in pgx's default exec mode (cache_statement): claims use a statement
// prepared in the session, or none with Config.LiteralClaim. When the
// statement goes missing (deallocated here, a pooler's server connection
// changing in real life), the delivery is still processed once, and the
// switch to the literal INSERT is logged once (info).
func TestTransactionalPreparedClaim(t *testing.T) {
	t.Parallel()
	for _, literal := range []bool{false, true} {
		t.Run(fmt.Sprintf("LiteralClaim=%v", literal), func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			cfg, err := pgxpool.ParseConfig(testenv.DirectDatabaseURL())
			require.NoError(t, err)
			cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeCacheStatement
			cfg.MaxConns = 1 // one session: the one the claims prepare in
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			require.NoError(t, err)
			defer pool.Close()
			tables := testenv.WithConn(testenv.Schema(t), wsql.BeginnerFromPgx(pool))

			logger := watermill.NewCaptureLogger()
			var counters testenv.Counters
			eo, err := exactlyonce.New(exactlyonce.Config{DB: tables, Consumer: "c", LiteralClaim: literal,
				OnEvent: counters.Observe, Logger: logger})
			require.NoError(t, err)
			calls := 0
			h := eo.Middleware(func(msg *message.Message) ([]*message.Message, error) {
				calls++
				tx, err := exactlyonce.PgxTxFromContext(msg.Context())
				if err != nil {
					return nil, err
				}
				_, err = tx.Exec(msg.Context(), "SELECT 1")
				return nil, err
			})
			prepared := func() []string {
				rows, err := pool.Query(ctx, "SELECT name FROM pg_prepared_statements WHERE from_sql", pgx.QueryExecModeSimpleProtocol)
				require.NoError(t, err)
				names, err := pgx.CollectRows(rows, pgx.RowTo[string])
				require.NoError(t, err)
				return names
			}
			infos := func() (n int) {
				for _, m := range logger.Captured()[watermill.InfoLogLevel] {
					if strings.Contains(m.Msg, "prepared statement") {
						n++
					}
				}
				return n
			}

			_, err = h(message.NewMessage("m-1", nil))
			require.NoError(t, err)
			names := prepared()
			if literal {
				require.Empty(t, names)
			} else {
				require.Len(t, names, 1)
				_, err = pool.Exec(ctx, "DEALLOCATE "+names[0])
				require.NoError(t, err)
			}
			for _, uuid := range []string{"m-2", "m-2", "m-3", "m-1"} {
				_, err = h(message.NewMessage(uuid, nil))
				require.NoError(t, err)
			}
			require.Empty(t, prepared())
			require.Equal(t, 3, calls)
			require.Equal(t, int64(3), counters.Processed.Load())
			require.Equal(t, int64(2), counters.Duplicates.Load())
			if literal {
				require.Zero(t, infos())
			} else {
				require.Equal(t, 1, infos(), "the switch is logged once")
			}
		})
	}
}
