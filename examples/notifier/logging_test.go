package main

import (
	"errors"
	"fmt"
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/watermill-exactlyonce/exactlyonce"
)

// recordingLogger records the level of each log call.
type recordingLogger struct {
	watermill.NopLogger
	lines *[]string
}

func (l recordingLogger) Error(msg string, err error, _ watermill.LogFields) {
	*l.lines = append(*l.lines, "error: "+msg+": "+err.Error())
}

func (l recordingLogger) Debug(msg string, fields watermill.LogFields) {
	*l.lines = append(*l.lines, fmt.Sprintf("debug: %s: %v", msg, fields["err"]))
}

func (l recordingLogger) With(watermill.LogFields) watermill.LoggerAdapter { return l }

// TestQuietLogger: the router's logger logs a held lease (an expected nack)
// at debug with its error, and every other error at error level, also
// through With.
func TestQuietLogger(t *testing.T) {
	t.Parallel()
	var lines []string
	var l watermill.LoggerAdapter = quietLogger{LoggerAdapter: recordingLogger{lines: &lines}, expected: []error{exactlyonce.ErrLeaseHeld}}
	l = l.With(watermill.LogFields{"handler": "send"})
	held := fmt.Errorf("exactlyonce: %w: key k", exactlyonce.ErrLeaseHeld)
	l.Error("Handler returned error", held, nil)
	l.Error("Handler returned error", errors.New("provider down"), nil)
	l.Error("Handler returned error", fmt.Errorf("x: %w", exactlyonce.ErrDBUnavailable), nil)
	require.Equal(t, []string{
		"debug: Handler returned error: " + held.Error(),
		"error: Handler returned error: provider down",
		"error: Handler returned error: x: database unavailable",
	}, lines)
}
