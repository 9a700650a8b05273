package main

import (
	"errors"
	"fmt"
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

func TestOneLine(t *testing.T) {
	t.Parallel()
	const role = `127.0.0.1:5432 (127.0.0.1): server error: FATAL: role "x" does not exist (SQLSTATE 28000)`
	tests := []struct{ name, in, want string }{
		{"one line", "connect: refused", "connect: refused"},
		{"one address, twice (sslmode=prefer)",
			"connect: failed to connect to `user=x database=d`:\n\t" + role + "\n\t" + role,
			"connect: failed to connect to `user=x database=d`: " + role},
		{"two addresses",
			"failed to connect to `user=u database=x`:\n\t127.0.0.1:1 (localhost): dial error\n\t[::1]:1 (localhost): dial error",
			"failed to connect to `user=u database=x`: 127.0.0.1:1 (localhost): dial error; [::1]:1 (localhost): dial error"},
		{"lines without a colon", "first\nsecond\n\nsecond\tthird\nsecond", "first; second; second third"},
		{"empty", "", ""},
	}
	for _, tt := range tests {
		if got := oneLine(tt.in); got != tt.want {
			t.Errorf("%s: oneLine(%q)\n = %q\nwant %q", tt.name, tt.in, got, tt.want)
		}
	}
}

// Error fields given to a log call and to With both reach the log line as
// oneLine of their message; other fields are left alone.
func TestOneLineErrors(t *testing.T) {
	t.Parallel()
	core, logs := observer.New(zapcore.InfoLevel)
	log := zap.New(oneLineErrors{core})
	multi := errors.New("connect:\n\ta: refused\n\ta: refused")
	log.With(zap.NamedError("cause", multi)).Warn("failed", zap.Error(fmt.Errorf("wrapped: %w", multi)), zap.Int("attempt", 2))
	log.Debug("below the level", zap.Error(multi))

	entries := logs.All()
	if len(entries) != 1 {
		t.Fatalf("%d entries logged, want 1", len(entries))
	}
	got := entries[0].ContextMap()
	want := map[string]any{"cause": "connect: a: refused", "error": "wrapped: connect: a: refused", "attempt": int64(2)}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("fields = %v, want %v", got, want)
	}
}
