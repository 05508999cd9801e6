package testenv

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
)

// Explain runs an EXPLAIN statement and returns its plan, a line each: the
// plan tests' reading of what the database will do.
func Explain(ctx context.Context, t testing.TB, db wsql.ContextExecutor, query string, args ...any) string {
	t.Helper()
	rs, err := db.QueryContext(ctx, query, args...)
	require.NoError(t, err)
	var plan strings.Builder
	for rs.Next() {
		var line string
		require.NoError(t, rs.Scan(&line))
		plan.WriteString(line + "\n")
	}
	require.NoError(t, seam.Close(rs))
	return plan.String()
}

// SQLLiteral renders a query argument as an SQL literal, so that a plan
// test can EXPLAIN the statement with its values in place (a custom plan).
func SQLLiteral(t testing.TB, a any) string {
	t.Helper()
	quote := func(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }
	switch v := a.(type) {
	case string:
		return quote(v)
	case int:
		return strconv.Itoa(v)
	case int64:
		return strconv.FormatInt(v, 10)
	case time.Time:
		return quote(v.Format(time.RFC3339Nano)) + "::timestamptz"
	case []int64:
		s := make([]string, len(v))
		for i, id := range v {
			s[i] = strconv.FormatInt(id, 10)
		}
		return quote("{" + strings.Join(s, ",") + "}")
	}
	t.Fatalf("no literal for %T", a)
	return fmt.Sprint(a)
}
