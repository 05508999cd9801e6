package sqlschema_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestConfigValidate(t *testing.T) {
	t.Parallel()

	valid := []sqlschema.Config{
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
		cfg   sqlschema.Config
		field string
	}{
		{"injection in schema", sqlschema.Config{Schema: `x"; DROP TABLE y; --`}, "Schema"},
		{"injection in inbox table", sqlschema.Config{InboxTable: `x"; DROP TABLE y; --`}, "InboxTable"},
		{"injection in outbox table", sqlschema.Config{OutboxTable: `x"; DROP TABLE y; --`}, "OutboxTable"},
		{"single quote", sqlschema.Config{InboxTable: "o'brien"}, "InboxTable"},
		{"comment", sqlschema.Config{Schema: "a--b"}, "Schema"},
		{"41 bytes", sqlschema.Config{InboxTable: strings.Repeat("a", 41)}, "InboxTable"},
		{"very long", sqlschema.Config{OutboxTable: strings.Repeat("b", 500)}, "OutboxTable"},
		{"leading digit", sqlschema.Config{Schema: "1schema"}, "Schema"},
		{"leading digit table", sqlschema.Config{OutboxTable: "2outbox"}, "OutboxTable"},
		{"unicode letter", sqlschema.Config{Schema: "schéma"}, "Schema"},
		{"unicode table", sqlschema.Config{InboxTable: "входящие"}, "InboxTable"},
		{"space", sqlschema.Config{InboxTable: "in box"}, "InboxTable"},
		{"qualified", sqlschema.Config{InboxTable: "public.inbox"}, "InboxTable"},
		{"hyphen", sqlschema.Config{OutboxTable: "out-box"}, "OutboxTable"},
		{"newline", sqlschema.Config{Schema: "a\nb"}, "Schema"},
		{"NUL", sqlschema.Config{Schema: "a\x00b"}, "Schema"},
		{"only spaces", sqlschema.Config{Schema: "   "}, "Schema"},
		{"inbox and outbox share a name", sqlschema.Config{InboxTable: "t", OutboxTable: "t"}, "InboxTable"},
		{"outbox named like the default inbox", sqlschema.Config{OutboxTable: sqlschema.DefaultInboxTable}, "OutboxTable"},
	}
	for _, tc := range invalid {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			err := tc.cfg.Validate()
			require.ErrorIs(t, err, sqlschema.ErrInvalidName)
			require.Contains(t, err.Error(), "Config."+tc.field, "the error names the field")
			require.Less(t, len(err.Error()), 300, "the error stays readable for long names")

			_, err = sqlschema.Migrations(tc.cfg)
			require.ErrorIs(t, err, sqlschema.ErrInvalidName)
			_, err = sqlschema.SQL(tc.cfg)
			require.ErrorIs(t, err, sqlschema.ErrInvalidName)
		})
	}
}

func TestConfigWithDefaults(t *testing.T) {
	t.Parallel()
	cfg := sqlschema.Config{InboxTable: "my_inbox"}
	got := cfg.WithDefaults()
	require.Equal(t, sqlschema.Config{Schema: "public", InboxTable: "my_inbox", OutboxTable: "watermill_outbox"}, got)
	require.Equal(t, sqlschema.Config{InboxTable: "my_inbox"}, cfg, "the caller's struct is not changed")
	require.NoError(t, cfg.Validate())
	require.Equal(t, sqlschema.Config{InboxTable: "my_inbox"}, cfg)
}

func TestConfigQuotedNames(t *testing.T) {
	t.Parallel()
	require.Equal(t, `"public"."watermill_inbox"`, sqlschema.Config{}.Inbox())
	require.Equal(t, `"public"."watermill_outbox"`, sqlschema.Config{}.Outbox())

	cfg := sqlschema.Config{Schema: "Tenant_A", InboxTable: "In", OutboxTable: "Out"}
	require.Equal(t, `"Tenant_A"."In"`, cfg.Inbox(), "case is kept by quoting")
	require.Equal(t, `"Tenant_A"."Out"`, cfg.Outbox())

	require.Equal(t, `"s"."watermill_inbox"`, sqlschema.Config{Schema: "s"}.Inbox())
	require.Equal(t, `"public"."o"`, sqlschema.Config{OutboxTable: "o"}.Outbox())

	require.Equal(t, `"public"."watermill_outbox_accepted"`, sqlschema.Config{}.OutboxAcceptedSequence())
	require.Equal(t, `"Tenant_A"."Out_accepted"`, cfg.OutboxAcceptedSequence())
	long := sqlschema.Config{OutboxTable: strings.Repeat("o", 40)}
	require.NoError(t, long.Validate())
	require.Len(t, strings.Repeat("o", 40)+"_accepted", 49, "within PostgreSQL's 63 bytes for the longest table name")
	require.Equal(t, `"public"."`+strings.Repeat("o", 40)+`_accepted"`, long.OutboxAcceptedSequence())

	// Even without Validate, a quote in a name is escaped, not interpreted.
	evil := sqlschema.Config{Schema: `x"; DROP TABLE y; --`}
	require.Equal(t, `"x""; DROP TABLE y; --"."watermill_inbox"`, evil.Inbox())
}
