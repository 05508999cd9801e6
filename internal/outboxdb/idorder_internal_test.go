package outboxdb

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// The verdict names each thing that breaks the order, and an
// auto_increment_increment above 1 (several primaries) is one.
func TestIDOrderVerdict(t *testing.T) {
	t.Parallel()
	ok, why, err := idOrderVerdict("InnoDB", "InnoDB", true, 1)
	require.NoError(t, err)
	require.True(t, ok)
	require.Empty(t, why)

	ok, why, _ = idOrderVerdict("InnoDB", "InnoDB", true, 3)
	require.False(t, ok)
	require.Contains(t, why, "auto_increment_increment is 3: several primaries draw ids")

	ok, why, _ = idOrderVerdict("MyISAM", "", false, 2)
	require.False(t, ok)
	require.Len(t, strings.Split(why, "; "), 4, why)
}
