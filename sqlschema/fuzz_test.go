package sqlschema

// Fuzz target of the schema and table names (issue 5). Run it with
//   go test -run '^$' -fuzz FuzzDBNames -fuzztime 25s ./sqlschema/

import (
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// fuzzParseQualified parses s as PostgreSQL reads a dot-separated list of
// quoted identifiers ("a"."b", with "" standing for one quote inside). It
// returns false when s is anything else: an unescaped quote inside a name
// ends it early and leaves text that is not a dot or the end.
func fuzzParseQualified(s string) ([]string, bool) {
	var parts []string
	i := 0
	for {
		if i >= len(s) || s[i] != '"' {
			return nil, false
		}
		i++
		var b strings.Builder
		for {
			if i >= len(s) {
				return nil, false
			}
			if s[i] == '"' {
				if i+1 < len(s) && s[i+1] == '"' {
					b.WriteByte('"')
					i += 2
					continue
				}
				i++
				break
			}
			b.WriteByte(s[i])
			i++
		}
		parts = append(parts, b.String())
		if i == len(s) {
			return parts, true
		}
		if s[i] != '.' {
			return nil, false
		}
		i++
	}
}

// fuzzQuoted finds every quoted identifier in a SQL script (the migrations
// quote identifiers only; their string literals use single quotes and hold
// no double quote). It returns false on an unterminated one.
func fuzzQuoted(script string) ([]string, bool) {
	var out []string
	for i := 0; i < len(script); i++ {
		if script[i] != '"' {
			continue
		}
		var b strings.Builder
		i++
		for {
			if i >= len(script) {
				return nil, false
			}
			if script[i] == '"' {
				if i+1 < len(script) && script[i+1] == '"' {
					b.WriteByte('"')
					i += 2
					continue
				}
				break
			}
			b.WriteByte(script[i])
			i++
		}
		out = append(out, b.String())
	}
	return out, true
}

var fuzzPlainName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,39}$`)

// FuzzDBNames (an internal test: it reaches the unexported migrations and
// the invalid-name sentinel): for any schema and table names, nothing
// panics; Inbox(), Outbox() and the migrations table are always exactly two
// quoted identifiers
// holding the names given (defaults applied, NUL bytes dropped as pgx does),
// so a quote in a name can never end the identifier; Validate accepts only
// plain identifiers of at most 40 bytes with distinct table names, and a
// rejected DB is rejected by migrations and SQL too (errInvalidName); for an
// accepted DB the whole migration script quotes every identifier it uses,
// and those are only the configured names, their index and sequence names
// and the "C" collation.
func FuzzDBNames(f *testing.F) {
	f.Add("", "", "")
	f.Add("public", "watermill_inbox", "watermill_outbox")
	f.Add("Tenant_A", "In", "Out")
	f.Add(`x"; DROP TABLE y; --`, `a""b`, `"`)
	f.Add(`s`, `t"."u`, `x`)
	f.Add("a\x00b", "in\n", "out\xff")
	f.Add(strings.Repeat("a", 40), strings.Repeat("b", 41), "_")
	f.Add("schéma", "входящие", "1outbox")
	f.Add("s", "t", "t")
	f.Add("s", "", defaultInboxTable)
	f.Add("pg_catalog", "select", "from")

	f.Fuzz(func(t *testing.T, schema, inboxTable, outboxTable string) {
		cfg := DB{Schema: schema, InboxTable: inboxTable, OutboxTable: outboxTable}
		d := cfg.WithDefaults()
		noNUL := func(s string) string { return strings.ReplaceAll(s, "\x00", "") }
		for _, q := range []struct {
			got  string
			want []string
		}{
			{cfg.Inbox(), []string{noNUL(d.Schema), noNUL(d.InboxTable)}},
			{cfg.Outbox(), []string{noNUL(d.Schema), noNUL(d.OutboxTable)}},
			{cfg.migrations(), []string{noNUL(d.Schema), migrationsTable}},
		} {
			parts, ok := fuzzParseQualified(q.got)
			require.True(t, ok, "%q is not two quoted identifiers", q.got)
			require.Equal(t, q.want, parts, "%q", q.got)
		}

		err := cfg.Validate()
		if err != nil {
			require.ErrorIs(t, err, errInvalidName)
			_, merr := migrations(cfg)
			require.ErrorIs(t, merr, errInvalidName)
			_, serr := SQL(cfg)
			require.ErrorIs(t, serr, errInvalidName)
			return
		}
		for _, n := range []string{d.Schema, d.InboxTable, d.OutboxTable} {
			require.Regexp(t, fuzzPlainName, n)
		}
		require.NotEqual(t, d.InboxTable, d.OutboxTable)
		require.Equal(t, `"`+d.Schema+`"."`+d.InboxTable+`"`, cfg.Inbox())

		script, err := SQL(cfg)
		require.NoError(t, err)
		idents, ok := fuzzQuoted(script)
		require.True(t, ok, "unterminated quoted identifier in:\n%s", script)
		for _, id := range idents {
			ok := id == d.Schema || id == d.InboxTable || id == d.OutboxTable || id == "C" ||
				strings.HasPrefix(id, d.InboxTable+"_") || strings.HasPrefix(id, d.OutboxTable+"_") ||
				id == migrationsTable
			require.True(t, ok, "unexpected identifier %q in the script", id)
			require.LessOrEqual(t, len(id), 63, "identifier %q is longer than PostgreSQL keeps", id)
		}
	})
}
