package inboxdb

import "time"

// PretendNewestPartitionEnds makes the store believe that the newest
// partition ends at end (and not re-read it for an hour): its claims are
// then recorded just before end, in the partition ending there, as when
// maintenance fell behind. Tests use it to place a claim in a past
// partition, across a boundary from another store's claims.
func (s *Store) PretendNewestPartitionEnds(end time.Time) {
	s.part.mu.Lock()
	defer s.part.mu.Unlock()
	s.part.newest = end
	s.part.checked = time.Now().Add(time.Hour)
}
