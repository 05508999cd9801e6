package exactlyonce

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"

	"github.com/exactlyonce/watermill-exactlyonce/internal/leasestore"
	"github.com/exactlyonce/watermill-exactlyonce/sqlschema"
)

// startupCheckTimeout bounds one run of the start-up check.
const startupCheckTimeout = 2 * time.Second

// startupCheck is the middleware's one-time check of its store, run at the
// end of the first delivery whose claim succeeded (so that a message
// refused before the database, an invalid key, touches nothing). It stays
// pending until it got an answer: a store that cannot be reached gives
// none, and the check runs again after the next successful claim.
type startupCheck struct {
	pending atomic.Bool // no answer yet
	due     atomic.Bool // the next delivery runs it
	mu      sync.Mutex  // one run at a time; concurrent deliveries skip it
}

// runCheck runs the start-up check in this delivery if it is pending and
// due. ctx is the message's context.
func (m *Guard) runCheck(ctx context.Context) {
	if !m.check.due.Load() || !m.check.mu.TryLock() {
		return
	}
	defer m.check.mu.Unlock()
	if !m.check.due.Swap(false) || !m.check.pending.Load() {
		return
	}
	// The message's context: a router that closes does not wait for it.
	cctx, cancel := context.WithTimeout(ctx, startupCheckTimeout)
	defer cancel()
	if m.runStartupCheck(cctx) {
		m.check.pending.Store(false)
	}
}

// runStartupCheck checks once that the tables are migrated to this version
// of the library (PostgreSQL) or that the lease store's server keeps what
// it is told (Redis: persistence, eviction), and logs what it found. It
// reports whether it got an answer.
func (m *Guard) runStartupCheck(ctx context.Context) bool {
	if m.lease != nil && !m.lease.Transactional() {
		c, ok := m.lease.(leasestore.Checker)
		if !ok {
			return true
		}
		problems, err := c.StartupCheck(ctx)
		if err != nil {
			return m.checkFailed(ctx, err, m.lease.Unreachable(err))
		}
		for _, p := range problems {
			m.cfg.Logger.Error("exactlyonce: start-up check: "+p, nil, nil)
		}
		if len(problems) == 0 {
			m.cfg.Logger.Info("exactlyonce: start-up check passed: the lease store's server keeps its records (append-only file, no eviction)", nil)
		}
		return true
	}
	// Tables created from sqlschema.SQL by another migration tool record
	// no migration: the check cannot tell (the claim that just succeeded
	// found the inbox table).
	status, err := sqlschema.Status(ctx, m.cfg.DB)
	if err != nil {
		return m.checkFailed(ctx, err, m.unreachable(err))
	}
	if !anyApplied(status) {
		m.cfg.Logger.Info("exactlyonce: start-up check: no migration is recorded for these tables (created with sqlschema.SQL by another tool?): not checked", watermill.LogFields{
			"schema": m.names.Schema, "inbox_table": m.names.Inbox, "outbox_table": m.names.Outbox})
		return true
	}
	err = sqlschema.Check(ctx, m.cfg.DB)
	switch {
	case err == nil:
		m.cfg.Logger.Info("exactlyonce: start-up check passed: the tables are migrated to this version of the library", watermill.LogFields{
			"schema": m.names.Schema, "inbox_table": m.names.Inbox, "outbox_table": m.names.Outbox})
		return true
	case errors.Is(err, sqlschema.ErrNotMigrated):
		m.cfg.Logger.Error("exactlyonce: start-up check: the tables are not migrated to this version of the library; deliveries that need what is missing fail until they are", err, nil)
		return true
	}
	return m.checkFailed(ctx, err, m.unreachable(err))
}

// checkFailed logs a start-up check that could not tell; it reports
// whether that is final (not an unreachable store, which is asked again).
func (m *Guard) checkFailed(ctx context.Context, err error, unreachable bool) bool {
	if unreachable || ctx.Err() != nil {
		m.cfg.Logger.Info("exactlyonce: start-up check: the store cannot be reached now; checked again after the first successful claim", watermill.LogFields{"err": err.Error()})
		return false
	}
	m.cfg.Logger.Info("exactlyonce: start-up check could not tell (check the set-up yourself): "+strings.TrimPrefix(err.Error(), "exactlyonce: "), nil)
	return true
}

// anyApplied reports whether the migrations table records any of status.
func anyApplied(status []sqlschema.MigrationStatus) bool {
	for _, st := range status {
		if st.Applied {
			return true
		}
	}
	return false
}
