package outbox

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// The start-up check's verdict on the recorded migrations. The library has
// one outbox migration today, so a table migrated by an earlier version
// (some recorded, some missing) cannot be made in the database yet: the
// rows below stand for a later version with two.
func TestMigrationVerdict(t *testing.T) {
	t.Parallel()
	st := func(target, name string, applied bool) sqlschema.MigrationStatus {
		return sqlschema.MigrationStatus{Target: target, Name: name, Applied: applied}
	}
	inbox := st("inbox", "inbox_001_create", false) // not the relay's concern
	for _, tc := range []struct {
		name        string
		status      []sqlschema.MigrationStatus
		level, says string
	}{
		{"all applied", []sqlschema.MigrationStatus{inbox, st("outbox", "outbox_001_create", true), st("outbox", "outbox_002_next", true)},
			"INFO", "start-up check passed"},
		{"none recorded", []sqlschema.MigrationStatus{inbox, st("outbox", "outbox_001_create", false), st("outbox", "outbox_002_next", false)},
			"INFO", "no migration is recorded"},
		{"an earlier version", []sqlschema.MigrationStatus{inbox, st("outbox", "outbox_001_create", true), st("outbox", "outbox_002_next", false)},
			"ERROR", "not migrated to this version of the library (missing outbox_002_next)"},
	} {
		level, msg := migrationVerdict(tc.status)
		require.Equal(t, tc.level, level, tc.name)
		require.Contains(t, msg, tc.says, tc.name)
		require.NotContains(t, msg, "inbox_001", tc.name)
	}
}
