package main

import (
	"io"
	"testing"
)

// --tenant-key and $STAGEDRAIN_TENANT_KEY set relay.Config.TenantKey (the
// flag wins); unset, it is off.
func TestTenantKeyFlag(t *testing.T) {
	// Not parallel: t.Setenv.
	db := noDatabaseURL(t)
	for _, c := range []struct {
		env  string
		args []string
		want string
	}{
		{"", nil, ""},
		{"", []string{"--tenant-key", "apartment"}, "apartment"},
		{"tenant", nil, "tenant"},
		{"tenant", []string{"--tenant-key", "apartment"}, "apartment"},
		{"", []string{"--tenant-key", "apartment", "--schemas", "tenant_*", "--target", "asynq"}, "apartment"},
	} {
		t.Setenv("STAGEDRAIN_TENANT_KEY", c.env)
		f, rf := newRunFlags()
		if err := f.parse(append([]string{"--database-url", db}, c.args...), io.Discard); err != nil {
			t.Fatalf("$STAGEDRAIN_TENANT_KEY=%q %v: %v", c.env, c.args, err)
		}
		cfg, _, err := rf.config(f)
		if err != nil {
			t.Fatalf("$STAGEDRAIN_TENANT_KEY=%q %v: %v", c.env, c.args, err)
		}
		if cfg.TenantKey != c.want {
			t.Errorf("$STAGEDRAIN_TENANT_KEY=%q %v: TenantKey %q, want %q", c.env, c.args, cfg.TenantKey, c.want)
		}
	}

	// A key the target's format owns is a bad command line: one line,
	// exit 2, naming the flag (or the variable) and the collision.
	checkUsageError(t, runCLI("run", "--database-url", db, "--tenant-key", "class"),
		`run: --tenant-key "class" is a key the sidekiq target's format owns`, "such as \"apartment\"")
	checkUsageError(t, runCLI("run", "--database-url", db, "--tenant-key", "headers", "--target", "asynq"),
		`run: --tenant-key "headers" is a key the asynq target's format owns`)
	checkUsageError(t, runCLI("run", "--database-url", db, "--tenant-key=options", "--target", "streams", "--schemas", "t_*"),
		`run: --tenant-key "options" is a key the streams target's format owns`)
	checkUsageError(t, runCLI("run", "--database-url", db, "--tenant-key="), "--tenant-key", "must not be empty")
	t.Setenv("STAGEDRAIN_TENANT_KEY", "retry")
	checkUsageError(t, runCLI("run", "--database-url", db), `run: $STAGEDRAIN_TENANT_KEY (--tenant-key) "retry" is a key the sidekiq target's format owns`)
}
