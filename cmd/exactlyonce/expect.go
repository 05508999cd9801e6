package main

import (
	"github.com/spf13/cobra"

	"github.com/exactlyonce/watermill-exactlyonce/inbox"
)

// ifFlags are the precondition of an action on one key or one outbox row:
// what the operator saw. The show commands print the version (inbox show,
// parked show, outbox show); the action then acts only while the key, its
// parked message or the row is still so, and otherwise changes nothing and
// exits 4 (exitChanged), saying what it is now.
type ifFlags struct {
	version, uuid, status string
}

// register adds --if-version, and with key (an action on a key) --if-uuid
// and --if-status.
func (f *ifFlags) register(cmd *cobra.Command, shownBy string, key bool) {
	fl := cmd.Flags()
	fl.StringVar(&f.version, "if-version", "", "act only if the version is still this one (as '"+shownBy+"' prints it); else exit 4, nothing done")
	if key {
		fl.StringVar(&f.uuid, "if-uuid", "", "act only if the key's parked message is still this message (its UUID); else exit 4, nothing done")
		fl.StringVar(&f.status, "if-status", "", "act only if the key's status is still this one (parked, failed, done, ...); else exit 4, nothing done")
	}
}

func (f ifFlags) any() bool { return f.version != "" || f.uuid != "" || f.status != "" }

func (f ifFlags) expect() inbox.Expect {
	return inbox.Expect{Version: f.version, MessageUUID: f.uuid, Status: f.status}
}
