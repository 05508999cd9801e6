package inboxdb_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/inboxdb"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestKeyValidation(t *testing.T) {
	t.Parallel()
	invalid := []struct {
		name          string
		consumer, key string
		want          error
	}{
		{"empty key", "c", "", inboxdb.ErrEmptyKey},
		{"empty consumer", "", "k", inboxdb.ErrEmptyConsumer},
		{"1025 bytes", "c", strings.Repeat("k", 1025), inboxdb.ErrKeyTooLong},
		{"1026 bytes in 513 runes", "c", strings.Repeat("é", 513), inboxdb.ErrKeyTooLong},
		{"invalid UTF-8", "c", "k\xff\xfe", inboxdb.ErrInvalidKey},
		{"truncated UTF-8", "c", "\xc3", inboxdb.ErrInvalidKey},
		{"NUL byte", "c", "a\x00b", inboxdb.ErrInvalidKey},
		{"consumer with NUL byte", "c\x00", "k", inboxdb.ErrInvalidKey},
		{"consumer not UTF-8", "\xff", "k", inboxdb.ErrInvalidKey},
	}
	valid := []struct{ name, key string }{
		{"1024 bytes", strings.Repeat("k", 1024)},
		{"1024 bytes in 512 runes", strings.Repeat("é", 512)},
		{"unicode", "ключ-🔑"},
		{"one byte", "x"},
		{"spaces and quotes", ` a'b"c `},
	}

	store, err := inboxdb.NewStore(inboxdb.Config{})
	require.NoError(t, err)
	for _, tc := range invalid {
		require.ErrorIs(t, store.ValidateKey(tc.consumer, tc.key), tc.want, tc.name)
	}
	for _, tc := range valid {
		require.NoError(t, store.ValidateKey("c", tc.key), tc.name)
	}

	short, err := inboxdb.NewStore(inboxdb.Config{MaxKeyLength: 8})
	require.NoError(t, err)
	require.NoError(t, short.ValidateKey("c", "12345678"))
	require.ErrorIs(t, short.ValidateKey("c", "123456789"), inboxdb.ErrKeyTooLong)

	// ClaimTx refuses the same keys and writes nothing; valid ones round-trip
	// byte for byte.
	eachEngine(t, func(t *testing.T, b bundle) {
		for _, tc := range invalid {
			tx := b.begin(t)
			res, err := b.store.ClaimTx(b.ctx, tx, tc.consumer, tc.key)
			require.ErrorIs(t, err, tc.want, tc.name)
			require.False(t, res.Claimed)
			require.NoError(t, tx.Commit(), "a rejected key leaves the transaction usable")
		}
		require.Zero(t, b.count(t, ""))

		for _, tc := range valid {
			require.True(t, b.claim(t, "c", tc.key).Claimed, tc.name)
			rec, err := b.store.Lookup(b.ctx, b.db, "c", tc.key)
			require.NoError(t, err, tc.name)
			require.Equal(t, tc.key, rec.Key)
			require.False(t, b.claim(t, "c", tc.key).Claimed, tc.name)
		}
	})
}

func TestNewStoreConfig(t *testing.T) {
	t.Parallel()
	for _, n := range []int{-1, 2049, 1 << 20} {
		_, err := inboxdb.NewStore(inboxdb.Config{MaxKeyLength: n})
		require.Error(t, err)
		require.Contains(t, err.Error(), "MaxKeyLength")
	}
	for _, n := range []int{0, 1, 2048} {
		_, err := inboxdb.NewStore(inboxdb.Config{MaxKeyLength: n})
		require.NoError(t, err, n)
	}

	_, err := inboxdb.NewStore(inboxdb.Config{Tables: sqlschema.DB{InboxTable: `x"; DROP TABLE y; --`}})
	require.ErrorContains(t, err, "invalid SQL identifier")
	require.Contains(t, err.Error(), "Config.Tables")
	require.Contains(t, err.Error(), "InboxTable")

	s, err := inboxdb.NewStore(inboxdb.Config{Tables: sqlschema.DB{Schema: "s", InboxTable: "In"}})
	require.NoError(t, err)
	require.Equal(t, `"s"."In"`, s.Table())
	s, err = inboxdb.NewStore(inboxdb.Config{})
	require.NoError(t, err)
	require.Equal(t, `"public"."watermill_inbox"`, s.Table())

	cfg := inboxdb.Config{}
	require.Equal(t, inboxdb.DefaultMaxKeyLength, cfg.WithDefaults().MaxKeyLength)
	require.Equal(t, "watermill_inbox", cfg.WithDefaults().Tables.InboxTable)
	require.Equal(t, sqlschema.DB{}.WithDefaults(), cfg.WithDefaults().Tables)
	require.Zero(t, cfg, "WithDefaults returns a copy")
}
