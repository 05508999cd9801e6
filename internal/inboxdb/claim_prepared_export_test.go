package inboxdb

// PreparedClaimName is the name of the store's prepared claim statement; a
// store of the partitioned layout has none, and returns a text no query
// contains.
func (s *Store) PreparedClaimName() string {
	if s.prep == nil {
		return "\x01no prepared claim (partitioned layout)"
	}
	return s.prep.name
}

// PreparedClaimOff reports whether the store claims with the literal INSERT
// for good (Config.LiteralClaim, or a prepared statement found missing); a
// store of the partitioned layout never uses the prepared claim.
func (s *Store) PreparedClaimOff() bool { return s.prep == nil || s.prep.off.Load() }
