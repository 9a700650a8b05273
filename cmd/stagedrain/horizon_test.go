package main

import (
	"io"
	"testing"
	"time"
)

// --horizon-warn-after and $STAGEDRAIN_HORIZON_WARN_AFTER set
// relay.Config.HorizonWarnAfter (the flag wins); 0 turns the check off,
// which the library spells -1.
func TestHorizonWarnAfterFlag(t *testing.T) {
	// Not parallel: t.Setenv.
	db := noDatabaseURL(t)
	for _, c := range []struct {
		env  string
		args []string
		want time.Duration
	}{
		{"", nil, 30 * time.Second},
		{"", []string{"--horizon-warn-after", "2m"}, 2 * time.Minute},
		{"", []string{"--horizon-warn-after", "0"}, -1},
		{"10s", nil, 10 * time.Second},
		{"0s", nil, -1},
		{"10s", []string{"--horizon-warn-after", "1m"}, time.Minute},
	} {
		t.Setenv("STAGEDRAIN_HORIZON_WARN_AFTER", c.env)
		f, rf := newRunFlags()
		if err := f.parse(append([]string{"--database-url", db}, c.args...), io.Discard); err != nil {
			t.Fatalf("$STAGEDRAIN_HORIZON_WARN_AFTER=%q %v: %v", c.env, c.args, err)
		}
		cfg, _, err := rf.config(f)
		if err != nil {
			t.Fatalf("$STAGEDRAIN_HORIZON_WARN_AFTER=%q %v: %v", c.env, c.args, err)
		}
		if cfg.HorizonWarnAfter != c.want {
			t.Errorf("$STAGEDRAIN_HORIZON_WARN_AFTER=%q %v: HorizonWarnAfter %s, want %s", c.env, c.args, cfg.HorizonWarnAfter, c.want)
		}
	}
}
