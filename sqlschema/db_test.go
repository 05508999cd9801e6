package sqlschema

// Internal tests: they reach the unexported migrations, the invalid-name
// sentinel and the outbox's sequence name, which the package's exported API
// no longer shows.

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestDBValidate(t *testing.T) {
	t.Parallel()

	valid := []DB{
		{},
		{Schema: "public"},
		{Schema: "_s", InboxTable: "In_1", OutboxTable: "OUT_1"},
		{InboxTable: strings.Repeat("a", 40)},
		{OutboxTable: "watermill_inbox2"},
	}
	for _, cfg := range valid {
		require.NoError(t, cfg.Validate(), "%+v", cfg)
	}

	invalid := []struct {
		name  string
		cfg   DB
		field string
	}{
		{"injection in schema", DB{Schema: `x"; DROP TABLE y; --`}, "Schema"},
		{"injection in inbox table", DB{InboxTable: `x"; DROP TABLE y; --`}, "InboxTable"},
		{"injection in outbox table", DB{OutboxTable: `x"; DROP TABLE y; --`}, "OutboxTable"},
		{"single quote", DB{InboxTable: "o'brien"}, "InboxTable"},
		{"comment", DB{Schema: "a--b"}, "Schema"},
		{"41 bytes", DB{InboxTable: strings.Repeat("a", 41)}, "InboxTable"},
		{"very long", DB{OutboxTable: strings.Repeat("b", 500)}, "OutboxTable"},
		{"leading digit", DB{Schema: "1schema"}, "Schema"},
		{"leading digit table", DB{OutboxTable: "2outbox"}, "OutboxTable"},
		{"unicode letter", DB{Schema: "schéma"}, "Schema"},
		{"unicode table", DB{InboxTable: "входящие"}, "InboxTable"},
		{"space", DB{InboxTable: "in box"}, "InboxTable"},
		{"qualified", DB{InboxTable: "public.inbox"}, "InboxTable"},
		{"hyphen", DB{OutboxTable: "out-box"}, "OutboxTable"},
		{"newline", DB{Schema: "a\nb"}, "Schema"},
		{"NUL", DB{Schema: "a\x00b"}, "Schema"},
		{"only spaces", DB{Schema: "   "}, "Schema"},
		{"inbox and outbox share a name", DB{InboxTable: "t", OutboxTable: "t"}, "InboxTable"},
		{"outbox named like the default inbox", DB{OutboxTable: defaultInboxTable}, "OutboxTable"},
	}
	for _, tc := range invalid {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := tc.cfg.Validate()
			require.ErrorIs(t, err, errInvalidName)
			require.ErrorContains(t, err, "invalid SQL identifier", "the public text of the sentinel")
			require.Contains(t, err.Error(), "DB."+tc.field, "the error names the field")
			require.Less(t, len(err.Error()), 300, "the error stays readable for long names")

			_, err = migrations(tc.cfg)
			require.ErrorIs(t, err, errInvalidName)
			_, err = SQL(tc.cfg)
			require.ErrorIs(t, err, errInvalidName)
		})
	}
}

func TestDBWithDefaults(t *testing.T) {
	t.Parallel()
	cfg := DB{InboxTable: "my_inbox"}
	got := cfg.WithDefaults()
	require.Equal(t, DB{Schema: "public", InboxTable: "my_inbox", OutboxTable: "watermill_outbox"}, got)
	require.Equal(t, DB{InboxTable: "my_inbox"}, cfg, "the caller's struct is not changed")
	require.NoError(t, cfg.Validate())
	require.Equal(t, DB{InboxTable: "my_inbox"}, cfg)
	require.Equal(t, DB{Schema: "public", InboxTable: "watermill_inbox", OutboxTable: "watermill_outbox"}, DB{}.WithDefaults())
	require.Equal(t, "watermill_exactlyonce_migrations", migrationsTable, "the migrations table's name is part of the contract")
}

func TestDBQuotedNames(t *testing.T) {
	t.Parallel()
	require.Equal(t, `"public"."watermill_inbox"`, DB{}.Inbox())
	require.Equal(t, `"public"."watermill_outbox"`, DB{}.Outbox())
	require.Equal(t, `"public"."watermill_exactlyonce_migrations"`, DB{}.migrations())

	cfg := DB{Schema: "Tenant_A", InboxTable: "In", OutboxTable: "Out"}
	require.Equal(t, `"Tenant_A"."In"`, cfg.Inbox(), "case is kept by quoting")
	require.Equal(t, `"Tenant_A"."Out"`, cfg.Outbox())
	require.Equal(t, `"Tenant_A"."watermill_exactlyonce_migrations"`, cfg.migrations())

	require.Equal(t, `"s"."watermill_inbox"`, DB{Schema: "s"}.Inbox())
	require.Equal(t, `"public"."o"`, DB{OutboxTable: "o"}.Outbox())

	// Even without Validate, a quote in a name is escaped, not interpreted.
	evil := DB{Schema: `x"; DROP TABLE y; --`}
	require.Equal(t, `"x""; DROP TABLE y; --"."watermill_inbox"`, evil.Inbox())
}

func TestMigrations(t *testing.T) {
	t.Parallel()
	migs, err := migrations(DB{})
	require.NoError(t, err)
	require.NotEmpty(t, migs)
	seenOutbox := false
	last := map[string]int{}
	for _, m := range migs {
		require.Contains(t, []string{"inbox", "outbox"}, m.Target, m.Name)
		if m.Target == "outbox" {
			seenOutbox = true
		} else {
			require.False(t, seenOutbox, "inbox migrations come first, got %s after an outbox one", m.Name)
		}
		require.Equal(t, last[m.Target]+1, m.Version, "versions of %s increase by one from 1", m.Target)
		last[m.Target] = m.Version
		require.True(t, strings.HasSuffix(m.Name, ".up.sql"), m.Name)
		require.NotContains(t, m.SQL, "{{", "template not rendered in %s", m.Name)
	}
	require.Equal(t, 2, last["inbox"], "inbox has its create and partitioned-claim-functions migrations")
	require.Equal(t, 1, last["outbox"], "outbox has its create migration")
}

// SQL is the schema followed by every migration, in order, each under a
// header naming it, its target and version: the format tests outside the
// package (scriptMigrations in main_test.go) and migration tools read.
func TestSQLListsEveryMigration(t *testing.T) {
	t.Parallel()
	cfg := DB{Schema: "s", InboxTable: "in", OutboxTable: "out"}
	migs, err := migrations(cfg)
	require.NoError(t, err)
	script, err := SQL(cfg)
	require.NoError(t, err)
	want := "CREATE SCHEMA IF NOT EXISTS \"s\";\n"
	for _, m := range migs {
		want += fmt.Sprintf("\n-- %s (target %s, version %d)\n%s", m.Name, m.Target, m.Version, m.SQL)
	}
	require.Equal(t, want, script)
}
