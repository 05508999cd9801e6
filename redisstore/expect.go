package redisstore

import (
	"context"
	"fmt"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
	"github.com/exactlyonce/watermill-exactlyonce/internal/parked"
)

// An operator's action with an inbox.Expect is checked in two steps that
// together are a compare-and-act: the key's record is read and the Expect
// checked against it here (the error says what changed), then the action's
// script runs with a guard, the record's fields as read, and does nothing
// (guardFailed) unless they still hold those values. So the script acts on
// exactly the state that passed the check.

// guard is the precondition of a script: pairs of a record field and the
// value it must hold ("" for an absent field), passed as the script's last
// ARGVs (see luaGuard). A nil guard checks nothing.
type guard []any

// guardFailed is a script's answer when its guard did not hold.
const guardFailed = -2

// luaGuard defines guarded(rec, from): whether the fields of rec hold the
// (field, value) pairs of ARGV from index from on (” for absent).
const luaGuard = `
local function guarded(rec, from)
	for i = from, #ARGV, 2 do
		if (redis.call('HGET', rec, ARGV[i]) or '') ~= ARGV[i + 1] then return false end
	end
	return true
end
`

// stateFields are the record's fields an Expect is checked against: the
// record's (inbox.Record.Version) and its parked message's
// (inbox.ParkedMessage.Version).
var stateFields = []string{"status", "attempts", "first_seen_ms", "processed_at_ms", "m_uuid", "parked_at_ms"}

// keyState is the key's record as an action with an Expect read it.
type keyState map[string]string

// readState reads the fields of (consumer, key) an Expect is checked
// against.
func (s *Store) readState(ctx context.Context, consumer, key string) (keyState, error) {
	vals, err := s.b.c.HMGet(ctx, s.b.recordKey(consumer, key), stateFields...).Result()
	if err != nil {
		return nil, fmt.Errorf("%q for %q: %w", key, consumer, err)
	}
	st := keyState{}
	for i, v := range vals {
		if v, ok := v.(string); ok {
			st[stateFields[i]] = v
		}
	}
	return st, nil
}

// guard is the guard of a script that must find the record as st.
func (st keyState) guard() guard {
	g := make(guard, 0, 2*len(stateFields))
	for _, f := range stateFields {
		g = append(g, f, st[f])
	}
	return g
}

// record is the key's record in st, as parseRecord reads it.
func (st keyState) record(consumer, key string) parked.RecordNow {
	r := parseRecord(consumer, key, st)
	return parked.RecordNow{Status: r.Status, Attempts: r.Attempts, FirstSeenAt: r.FirstSeenAt, ProcessedAt: r.ProcessedAt,
		MessageUUID: st["m_uuid"]}
}

// message is the key's parked message in st, as readParked reads it.
func (st keyState) message(consumer, key string) (parked.MessageNow, error) {
	m, err := readParked(consumer, key, func(f string) string { return st[f] }, false)
	if err != nil {
		return parked.MessageNow{}, err
	}
	return parked.MessageNow{UUID: m.UUID, ParkedAt: m.ParkedAt, Attempts: m.Attempts, Status: m.Status}, nil
}

// expectRecord checks expect against the record of (consumer, key) and
// returns the guard of the action's script; nil when expect checks
// nothing.
func (s *Store) expectRecord(ctx context.Context, consumer, key string, expect inbox.Expect) (guard, error) {
	e := parked.Expect(expect)
	if err := e.ValidateRecord(); err != nil || e.Empty() {
		return nil, err
	}
	st, err := s.readState(ctx, consumer, key)
	if err != nil {
		return nil, err
	}
	if st["status"] == "" {
		return nil, fmt.Errorf("%q for %q: %w", key, consumer, inbox.ErrNotFound)
	}
	if err := e.CheckRecord(consumer, key, st.record(consumer, key)); err != nil {
		return nil, err
	}
	return st.guard(), nil
}

// expectMessage checks expect against the parked message of (consumer,
// key) and returns the guard of the action's script; nil when expect
// checks nothing.
func (s *Store) expectMessage(ctx context.Context, consumer, key string, expect inbox.Expect) (guard, error) {
	e := parked.Expect(expect)
	if err := e.ValidateMessage(); err != nil || e.Empty() {
		return nil, err
	}
	st, err := s.readState(ctx, consumer, key)
	if err != nil {
		return nil, err
	}
	if _, message := st["m_uuid"]; st["status"] == "" || !message {
		return nil, fmt.Errorf("%w (consumer %q, key %q)", inbox.ErrNotParked, consumer, key)
	}
	m, err := st.message(consumer, key)
	if err != nil {
		return nil, err
	}
	if err := e.CheckMessage(consumer, key, m); err != nil {
		return nil, err
	}
	return st.guard(), nil
}

// parkGuard is the guard of a bulk action's step: the park it found
// (parked_at_ms as read), so that a message parked again since is left.
func parkGuard(parkedAtMS string) guard { return guard{"parked_at_ms", parkedAtMS} }

// changedMeanwhile is the error of a script whose guard did not hold: the
// key changed between the check and the action.
func changedMeanwhile(consumer, key string) error {
	return fmt.Errorf("%w: key %q for %q changed while the action was checked (another operator, or a delivery): look again", inbox.ErrChanged, key, consumer)
}
