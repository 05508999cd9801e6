package main

import (
	"bufio"
	"bytes"
	"embed"
	"fmt"
	"strings"
	"text/template"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// queryFiles are the notifier's own statements, one file per dialect:
// queries/postgres/notifier.sql and queries/mysql/notifier.sql, the same
// statement names in both.
//
//go:embed queries
var queryFiles embed.FS

// statements are the notifier's statements rendered for one database: its
// dialect and its notification_log table.
type statements map[string]string

// queryNames are the statements every dialect's file defines; MigrateLock is
// PostgreSQL's only.
var queryNames = []string{"CreateLog", "RecordSent", "SetStatus", "LockLogRow", "CountLog", "DropSchema"}

// loadStatements renders the dialect's file for db's schema. A file is a
// series of statements, each introduced by a "-- name: X" line and running
// to the next one; each is a text/template that names the quoted table
// ({{.Log}}) or schema ({{.Schema}}). Comment lines are the reader's: they
// are not sent.
func loadStatements(db sqlschema.DB) (statements, error) {
	dialect := sqlschema.Postgres
	if db.Dialect == sqlschema.MySQL {
		dialect = sqlschema.MySQL
	}
	path := "queries/" + dialect.String() + "/notifier.sql"
	src, err := queryFiles.ReadFile(path)
	if err != nil {
		return nil, err
	}
	schema := db.WithDefaults().Schema
	data := struct{ Log, Schema string }{
		Log:    dialect.QuoteIdentifier(schema, "notification_log"),
		Schema: dialect.QuoteIdentifier(schema),
	}
	st := statements{}
	var name string
	var body strings.Builder
	flush := func() error {
		if name == "" {
			return nil
		}
		t, err := template.New(name).Option("missingkey=error").Parse(strings.TrimSpace(body.String()))
		if err != nil {
			return err
		}
		var out strings.Builder
		if err := t.Execute(&out, data); err != nil {
			return err
		}
		if _, dup := st[name]; dup {
			return fmt.Errorf("statement %s is defined twice", name)
		}
		st[name] = out.String()
		body.Reset()
		return nil
	}
	sc := bufio.NewScanner(bytes.NewReader(src))
	for sc.Scan() {
		line := sc.Text()
		if n, ok := strings.CutPrefix(strings.TrimSpace(line), "-- name:"); ok {
			if err := flush(); err != nil {
				return nil, fmt.Errorf("%s: %w", path, err)
			}
			name = strings.TrimSpace(n)
			continue
		}
		if name != "" && !strings.HasPrefix(strings.TrimSpace(line), "--") {
			body.WriteString(line)
			body.WriteByte('\n')
		}
	}
	if err := flush(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	names := queryNames
	if dialect == sqlschema.Postgres {
		names = append(names[:len(names):len(names)], "MigrateLock")
	}
	for _, n := range names {
		if st[n] == "" {
			return nil, fmt.Errorf("%s: statement %s is missing", path, n)
		}
	}
	return st, nil
}
