package outbox_test

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/internal/seam"
	"github.com/exactlyonce/watermill-exactlyonce/internal/testenv"
)

// TestOrderedScenarioNeedsTheKeyLock: the writers of orderedScenario (and
// of tests/chaos TestChaosOrdered) take a message's sequence number after
// Publish, so that only the ordering key's lock makes a key's ids follow
// its sequence. Without keys (no lock), some key's ids are out of sequence
// order: the scenario can catch a missing or misplaced writer lock. (Its
// writers took the number first, under the counter's row lock, which
// ordered the ids on its own.)
func TestOrderedScenarioNeedsTheKeyLock(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b := newBundle(t, ctx, testenv.Drivers(t)[0].DB, testenv.Schema(t))
	orderedScenario(t, b, 10, 40, 6, false) // no ordering keys: no advisory lock
	rs, err := b.db.QueryContext(ctx, `SELECT metadata->>'key', (metadata->>'seq')::int FROM `+b.tables.Outbox()+` ORDER BY id`)
	require.NoError(t, err)
	last := map[string]int{}
	outOfOrder := 0
	for rs.Next() {
		var k string
		var seq int
		require.NoError(t, rs.Scan(&k, &seq))
		if seq < last[k] {
			outOfOrder++
		}
		last[k] = max(last[k], seq)
	}
	require.NoError(t, seam.Close(rs))
	require.NotZero(t, outOfOrder, "without the ordering-key lock the scenario's ids still follow each key's sequence ("+strconv.Itoa(len(last))+" keys): it cannot catch a broken writer lock")
	t.Logf("without the key lock: %d rows out of their key's sequence order", outOfOrder)
}
