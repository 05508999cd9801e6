package sqlschema

import (
	"testing"

	"github.com/stretchr/testify/require"
)

// The server versions the MySQL dialect accepts: those with SKIP LOCKED.
func TestCheckVersion(t *testing.T) {
	for _, tc := range []struct {
		version string
		ok      bool
	}{
		{"10.11.19-MariaDB-0+deb12u1", true},
		{"10.6.0-MariaDB", true},
		{"10.5.23-MariaDB-log", false},
		{"11.4.2-MariaDB", true},
		{"8.0.36", true},
		{"8.4.0-commercial", true},
		{"5.7.44-log", false},
		{"garbage", false},
	} {
		err := checkVersion(tc.version)
		if tc.ok {
			require.NoError(t, err, tc.version)
		} else {
			require.ErrorIs(t, err, ErrEngine, tc.version)
		}
	}
}

// A migration's statements, split where a line ends in ";".
func TestSplitStatements(t *testing.T) {
	got := splitStatements("-- a comment;\nCREATE TABLE a (\n  x INT\n);\n\n-- b\nCREATE TABLE b (y INT);\nSELECT 1")
	require.Equal(t, []string{"CREATE TABLE a (\n  x INT\n)", "CREATE TABLE b (y INT)", "SELECT 1"}, got)
}
