package main

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// withPassword returns rawURL with user (if not empty) and password set.
func withPassword(t *testing.T, rawURL, user, password string) string {
	t.Helper()
	u, err := url.Parse(rawURL)
	if err != nil {
		t.Fatalf("parse %q: %v", rawURL, err)
	}
	if user == "" {
		user = u.User.Username()
	}
	u.User = url.UserPassword(user, password)
	return u.String()
}

// Every command that fails, and every --help, with passwords in the URLs of
// its flags and environment: neither stdout nor stderr shows a password,
// and a failure is one line on stderr.
func TestPasswordNeverShownByAnyCommand(t *testing.T) {
	// Not parallel: t.Setenv.
	const pgPassword, redisPassword = "s3cret-pg-pw", "s3cret-redis-pw"
	refused := "postgres://u:" + pgPassword + "@127.0.0.1:1/x?sslmode=disable"
	badHost := "postgres://u:" + pgPassword + "@nosuchhost.invalid:5432/x?sslmode=disable"
	// The shared servers, with passwords that trust auth and a Redis
	// without requirepass accept, and a database that does not exist: run
	// gets past Redis and fails on PostgreSQL (exit 1) at once.
	noDB := withPassword(t, noDatabaseURL(t), "", pgPassword)
	sharedRedis := withPassword(t, relaytest.RedisURL(), "default", redisPassword)
	t.Setenv("DATABASE_URL", refused)
	t.Setenv("REDIS_URL", "redis://:"+redisPassword+"@127.0.0.1:1/0")

	tests := []struct {
		name string
		args []string
		code int
		want string // in the stderr line
	}{
		{"migrate, refused", []string{"migrate"}, 1, "connect to u@127.0.0.1:1/x"},
		{"migrate, bad host", []string{"migrate", "--database-url", badHost}, 1, "connect to u@nosuchhost.invalid:5432/x"},
		{"run, no such database", []string{"run", "--database-url", noDB, "--redis-url", sharedRedis}, 1, "3D000"},
		{"run, bad port", []string{"run", "--database-url", "postgres://u:" + pgPassword + "@h:port/x"}, 2, "--database-url"},
		{"run, bad redis url", []string{"run", "--redis-url", "redis://:" + redisPassword + "@h:port/x"}, 2, "--redis-url"},
		{"status, refused", []string{"status"}, 1, "connect to u@127.0.0.1:1/x"},
		{"status, bad host", []string{"status", "--database-url", badHost}, 1, "nosuchhost.invalid"},
		{"health, refused", []string{"health", "--metrics-addr", "127.0.0.1:1"}, 1, "127.0.0.1:1"},
		{"dead list, refused", []string{"dead", "list"}, 1, "dead list: connect to u@127.0.0.1:1/x"},
		{"dead retry, refused", []string{"dead", "retry", "--all"}, 1, "dead retry: connect to u@127.0.0.1:1/x"},
		{"dead purge, bad host", []string{"dead", "purge", "7", "--database-url", badHost}, 1, "dead purge: connect to u@nosuchhost.invalid:5432/x"},
		{"bench, refused", []string{"bench", "--quick"}, 1, "bench: connect to u@127.0.0.1:1/x"},
		{"bench, bad redis url", []string{"bench", "--redis-url", "rediss://:" + redisPassword + "@h:port/0"}, 2, "--redis-url"},
	}
	for _, cmd := range [][]string{{"migrate"}, {"run"}, {"status"}, {"health"}, {"dead", "list"}, {"dead", "retry"}, {"dead", "purge"}, {"bench"}} {
		tests = append(tests, struct {
			name string
			args []string
			code int
			want string
		}{strings.Join(cmd, " ") + " --help", append(cmd, "--help"), 0, ""})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var r result
			done := make(chan struct{})
			go func() {
				defer close(done)
				r = runCLI(tt.args...)
			}()
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				t.Fatalf("stagedrain %s still running after 30s", strings.Join(tt.args, " "))
			}
			for _, pw := range []string{pgPassword, redisPassword} {
				if strings.Contains(r.stdout+r.stderr, pw) {
					t.Errorf("the password %s shows: stdout %q, stderr %q", pw, r.stdout, r.stderr)
				}
			}
			if tt.code == 0 {
				if r.code != 0 || r.stderr != "" || !strings.Contains(r.stdout, "Usage: stagedrain") {
					t.Errorf("exit %d, stdout %q, stderr %q; want 0 and the usage on stdout", r.code, r.stdout, r.stderr)
				}
				return
			}
			checkOneLineError(t, r, tt.code, tt.want)
		})
	}
}

// A role without DELETE on staged_jobs: run exits 1 at start with one line
// naming the missing privilege and the README section, before it leads,
// and the job stays staged; the password of its URL shows nowhere.
func TestRunWithoutPrivilegeExits(t *testing.T) {
	t.Parallel()
	const password = "s3cret-role-pw"
	e := newRelayEnv(t)
	role, roleURL := relaytest.Role(t, relaytest.DatabaseURL())
	for _, g := range []string{
		"GRANT USAGE ON SCHEMA %[1]s TO %[2]s",
		"GRANT SELECT, INSERT, UPDATE (id) ON %[1]s.staged_jobs TO %[2]s", // no DELETE
		"GRANT SELECT, INSERT, UPDATE ON %[1]s.staged_jobs_dead TO %[2]s",
		"GRANT SELECT ON %[1]s.stagedrain_migrations TO %[2]s",
	} {
		if _, err := e.conn.Exec(context.Background(), fmt.Sprintf(g, pgx.Identifier{e.schema}.Sanitize(), pgx.Identifier{role}.Sanitize())); err != nil {
			t.Fatal(err)
		}
	}
	e.stage("StaysStagedJob", 1)
	p := startProc(t, "relay", childEnv("DATABASE_URL="+withPassword(t, roleURL, "", password)), "run",
		"--schema", e.schema, "--redis-namespace", e.ns)
	if code := p.wait(15 * time.Second); code != 1 {
		t.Fatalf("exit code %d, want 1; output:\n%s", code, p.output())
	}
	stderr := p.stderr.snapshot()
	want := fmt.Sprintf(`stagedrain: permission denied: role %q lacks DELETE on %s: the relay's role needs USAGE on the schema; `+
		`SELECT, INSERT, DELETE and UPDATE (id) on staged_jobs; SELECT, INSERT and UPDATE on staged_jobs_dead; `+
		`SELECT on stagedrain_migrations (see README "Least-privilege role")`, role, pgx.Identifier{e.schema, "staged_jobs"}.Sanitize())
	if len(stderr) != 1 || stderr[0].raw != want {
		t.Fatalf("stderr:\n%s\nwant one line:\n%s", p.output(), want)
	}
	if p.count(rootLogger, "became leader") != 0 {
		t.Errorf("the relay became leader without DELETE")
	}
	if n := stagedCount(t, e.conn, e.schema); n != 1 {
		t.Errorf("%d rows staged, want 1", n)
	}
	if out := p.output(); strings.Contains(out, password) {
		t.Errorf("the password shows in the output:\n%s", out)
	}
}
