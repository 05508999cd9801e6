package inboxdb

import (
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// TestLockPlan checks the plan (lockOrder) and that the statement each
// writer locks with takes the plan's locks in the plan's order, for a
// write at now and a fallback write. Pure: the statements are rendered,
// never run.
func TestLockPlan(t *testing.T) {
	assert.Equal(t, []lock{lockKey}, lockOrder(opClaim, false))
	assert.Equal(t, []lock{lockFallbackShared, lockKey}, lockOrder(opClaim, true), "the fallback lock before the key's")
	assert.Equal(t, []lock{lockFallbackShared, lockKeysHashOrder}, lockOrder(opClaimBatch, true))
	assert.Equal(t, []lock{lockFallbackShared, lockKey}, lockOrder(opLeaseClaim, true))
	assert.Equal(t, []lock{lockFallbackShared, lockKey}, lockOrder(opPark, true))
	assert.Equal(t, []lock{lockKey}, lockOrder(opUpdate, true), "an update by key never takes the fallback lock")
	assert.Equal(t, []lock{lockPurgeTry, lockKeysHashOrder}, lockOrder(opPurgeMove, false))
	assert.Equal(t, []lock{lockFallbackExclusive}, lockOrder(opFence, false))
	assert.Equal(t, []lock{lockMaintenance}, lockOrder(opMaintain, false))
	assert.Empty(t, lockOrder(opDetachDrop, false), "DETACH CONCURRENTLY runs outside a transaction: no advisory lock")

	for _, interval := range []sqlschema.PartitionInterval{sqlschema.Daily, sqlschema.Hourly} {
		s, err := NewStore(Config{Tables: sqlschema.DB{Schema: "s", Partitions: &sqlschema.Partitioning{Interval: interval}}})
		require.NoError(t, err)
		p := s.part.locks
		// The advisory lock calls of a statement, in the order PostgreSQL
		// takes them: a select list left to right, a WHERE's init plan
		// before the rows it filters.
		calls := regexp.MustCompile(`pg_advisory_xact_lock(_shared)?\((` + "\\d+" + `, hashtext)?`)
		locksOf := func(text string, batch bool) []lock {
			var out []lock
			for _, m := range calls.FindAllStringSubmatch(text, -1) {
				switch {
				case m[1] == "_shared" && m[2] != "":
					out = append(out, lockFallbackShared)
				case m[2] != "":
					out = append(out, lockFallbackExclusive)
				case batch:
					out = append(out, lockKeysHashOrder)
				default:
					out = append(out, lockKey)
				}
			}
			// A batch's fallback lock is its WHERE's init plan, written
			// after the key locks but taken before them.
			if batch && len(out) == 2 && out[1] == lockFallbackShared {
				out[0], out[1] = out[1], out[0]
			}
			return out
		}
		for _, op := range []operation{opClaim, opClaimBatch, opLeaseClaim, opPark} {
			batch := op == opClaimBatch
			for _, fallback := range []bool{false, true} {
				text := p.placed(lockStatement(op), placement{fallback: fallback})
				assert.Equal(t, lockOrder(op, fallback), locksOf(text, batch), "%d fallback %v:\n%s", op, fallback, text)
			}
		}
		for _, fallback := range []bool{false, true} {
			text := p.beginClaim(placement{fallback: fallback}, "c", "k")
			assert.Equal(t, lockOrder(opClaim, fallback), locksOf(text, false), "the pgx fast path's BEGIN:\n%s", text)
		}
		assert.Equal(t, lockOrder(opUpdate, false), locksOf(p.q.get(lockStatement(opUpdate)), false))
		assert.Equal(t, []lock{lockKeysHashOrder}, locksOf(p.q.get(lockStatement(opPurgeMove)), true))
		assert.Regexp(t, `ORDER BY 1`, p.q.get(lockStatement(opPurgeMove)), "the purge takes the keys' locks in hash order")
		assert.Regexp(t, `ORDER BY 1`, p.placed(lockStatement(opClaimBatch), placement{}), "a batch takes the keys' locks in hash order")
		assert.Equal(t, lockOrder(opFence, false), locksOf(p.q.get(lockStatement(opFence)), false))
		assert.Regexp(t, `pg_try_advisory_xact_lock\(\d+, hashtext`, s.q.get("PurgeLock"), "the purge lock, without waiting")
		// The fallback lock and the fence are one lock.
		fb := regexp.MustCompile(`\d+, hashtext\('[^']+'\)`)
		assert.Equal(t, fb.FindString(p.q.get(lockStatement(opFence))), fb.FindString(p.placed(lockStatement(opClaim), placement{fallback: true})))
	}
}
