package inboxdb

// PreparedClaimName is the name of the store's prepared claim statement.
func (s *Store) PreparedClaimName() string { return s.prep.name }

// PreparedClaimOff reports whether the store claims with the literal INSERT
// for good (Config.LiteralClaim, or a prepared statement found missing).
func (s *Store) PreparedClaimOff() bool { return s.prep.off.Load() }
