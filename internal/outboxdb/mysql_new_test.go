package outboxdb

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

func TestNewRendersEachDialect(t *testing.T) {
	for _, d := range []sqlschema.Dialect{sqlschema.Postgres, sqlschema.MySQL} {
		s, err := New(sqlschema.DB{Dialect: d})
		require.NoError(t, err, d)
		require.NotNil(t, s)
	}
}
