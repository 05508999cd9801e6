package inboxdb

import "time"

// UseClaimFunctions switches the store's use of the partitioned layout's
// claim functions (migration inbox_002) on or off: off, every claim takes
// statements of its own (the key's lock, then the look-up and insert), as
// with a table whose functions are missing.
// Tests and benchmarks compare the two on one table.
func (s *Store) UseClaimFunctions(on bool) {
	f := &s.part.funcs
	f.mu.Lock()
	defer f.mu.Unlock()
	f.off = !on
	f.present = false
	f.checked = time.Time{}
}
