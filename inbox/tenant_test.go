package inbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// Tenant-scoped keys (exactlyonce.KeyByTenant) through the operator view:
// TenantKey finds a tenant's record, TenantStats counts one tenant's keys,
// and a purge limited to a tenant leaves the others' records alone — on
// both layouts (on the partitioned one a tenant purge deletes rows).
func TestTenantScopedOperations(t *testing.T) {
	for _, layout := range []string{"plain", "partitioned"} {
		t.Run(layout, func(t *testing.T) {
			t.Parallel()
			db := testenv.SchemaLayout(t, layout)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			store, err := inbox.NewStore(db)
			require.NoError(t, err)
			inner, err := inboxdb.NewStore(inboxdb.Config{Tables: db})
			require.NoError(t, err)
			b := bundle{ctx: ctx, db: db, store: store, inner: inner}

			key := func(tenant, k string) string {
				s, err := inbox.TenantKey(tenant, k)
				require.NoError(t, err)
				return s
			}
			for _, k := range []string{"a", "b", "c"} {
				b.claim(t, "billing", key("acme", k))
			}
			b.claim(t, "billing", key("acme2", "a")) // a tenant whose name extends another's
			b.claim(t, "billing", key("mallory", "a"))

			rec, err := store.Get(ctx, "billing", key("acme", "b"))
			require.NoError(t, err)
			require.Equal(t, "acme:b", rec.Key)

			st, err := store.TenantStats(ctx, "billing", "acme")
			require.NoError(t, err)
			require.Equal(t, int64(3), st.Total, "acme's keys only, not acme2's")
			st, err = store.TenantStats(ctx, "", "mallory")
			require.NoError(t, err)
			require.Equal(t, int64(1), st.Total)
			_, err = store.TenantStats(ctx, "billing", "")
			require.ErrorContains(t, err, "empty tenant")
			_, err = store.TenantStats(ctx, "billing", "a:b")
			require.ErrorContains(t, err, `contains ":"`)

			_, err = db.Conn.ExecContext(ctx, "UPDATE "+db.Inbox()+" SET processed_at = now() - interval '2 days'")
			require.NoError(t, err)
			n, err := store.Purge(ctx, inbox.PurgeOptions{OlderThan: time.Hour, Tenant: "acme"})
			require.NoError(t, err)
			require.Equal(t, int64(3), n)
			all, err := store.Stats(ctx, "")
			require.NoError(t, err)
			require.Equal(t, int64(2), all.Total, "acme2's and mallory's records are left")
			_, err = store.Get(ctx, "billing", key("acme2", "a"))
			require.NoError(t, err)

			_, err = inbox.TenantKey("", "a")
			require.Error(t, err)
			_, err = inbox.TenantKey("t", "")
			require.Error(t, err)
		})
	}
}
