package main

import (
	"context"
	"encoding/json"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// status reports the backlog by queue with the oldest job's age, the
// dead-letter count ("-" without the table) and the leader ("none" without
// one), as a table and as JSON; with a relay running, the leader is this
// process, named by its host and pid.
func TestStatus(t *testing.T) {
	t.Parallel()
	e := newRelayEnv(t)
	ctx := context.Background()
	table := pgx.Identifier{e.schema, "staged_jobs"}.Sanitize()
	// Two queues: default's oldest job is 90s old, critical's 5s.
	_, err := e.conn.Exec(ctx, `INSERT INTO `+table+` (job_name, job_args, queue, created_at) VALUES
		('A', '[]', 'default', now() - interval '90 seconds'),
		('B', '[]', 'default', now() - interval '10 seconds'),
		('C', '[]', 'default', now()),
		('D', '[]', 'critical', now() - interval '5 seconds'),
		('E', '[]', 'critical', now())`)
	if err != nil {
		t.Fatalf("stage jobs: %v", err)
	}
	args := []string{"status", "--database-url", relaytest.DatabaseURL(), "--schema", e.schema}

	r := runCLI(args...)
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("status: exit %d, stderr %q; want 0 and nothing", r.code, r.stderr)
	}
	for _, re := range []string{
		`(?m)^schema +` + regexp.QuoteMeta(e.schema) + `$`,
		`(?m)^staged +5, oldest 1m3\ds$`,
		`(?m)^dead +0$`,
		`(?m)^leader +none$`,
		`(?m)^QUEUE +STAGED +OLDEST$`,
		`(?m)^critical +2 +[56](\.\d)?s$`,
		`(?m)^default +3 +1m3\ds$`,
	} {
		if !regexp.MustCompile(re).MatchString(r.stdout) {
			t.Errorf("status output does not match %s:\n%s", re, r.stdout)
		}
	}

	st := statusJSON(t, args)
	if st.Staged != 5 || st.OldestAge == nil || *st.OldestAge < 90 || *st.OldestAge > 120 {
		t.Errorf("--json: staged %d, oldest %v; want 5, 90-120s", st.Staged, st.OldestAge)
	}
	if len(st.Queues) != 2 || st.Queues[0].Queue != "critical" || st.Queues[0].Staged != 2 ||
		st.Queues[1].Queue != "default" || st.Queues[1].Staged != 3 || st.Queues[1].OldestAge < 90 {
		t.Errorf("--json queues = %+v, want critical 2, default 3 (oldest >= 90s)", st.Queues)
	}
	if st.Dead == nil || *st.Dead != 0 || st.Leader != nil {
		t.Errorf("--json dead %v, leader %+v; want 0, null", st.Dead, st.Leader)
	}

	// Dead letters are counted.
	dead := pgx.Identifier{e.schema, "staged_jobs_dead"}.Sanitize()
	if _, err := e.conn.Exec(ctx, `INSERT INTO `+dead+` (id, reason, attempts) VALUES (1, 'test', 1), (2, 'test', 1)`); err != nil {
		t.Fatalf("insert into %s: %v", dead, err)
	}
	if st := statusJSON(t, args); st.Dead == nil || *st.Dead != 2 {
		t.Errorf("--json dead = %v, want 2", st.Dead)
	}
	if r := runCLI(args...); !regexp.MustCompile(`(?m)^dead +2$`).MatchString(r.stdout) {
		t.Errorf("status output does not show dead 2:\n%s", r.stdout)
	}

	// A relay in this process leads and drains the backlog.
	inProcessRelay(t, "--database-url", relaytest.DatabaseURL(), "--schema", e.schema,
		"--redis-url", relaytest.RedisURL(), "--redis-namespace", e.ns, "--metrics-addr", "")
	var leader *leaderStatus
	relaytest.WaitFor(t, 10*time.Second, "status to show a leader and nothing staged", func() (bool, string) {
		st := statusJSON(t, args)
		leader = st.Leader
		return st.Leader != nil && st.Staged == 0, strings.TrimSpace(runCLI(args...).stdout)
	})
	host, _ := os.Hostname()
	if leader.Host != host || leader.PID != os.Getpid() || leader.BackendPID == 0 || leader.ConnectedAt.IsZero() ||
		!strings.HasPrefix(leader.ApplicationName, "stagedrain leader ") {
		t.Errorf("--json leader = %+v, want host %s, pid %d, a backend pid and connection time", leader, host, os.Getpid())
	}
	r = runCLI(args...)
	want := `(?m)^leader +` + regexp.QuoteMeta(host) + ` pid ` + strconv.Itoa(os.Getpid()) + ` \(backend \d+.*, connected \S+\)$`
	if !regexp.MustCompile(want).MatchString(r.stdout) || !regexp.MustCompile(`(?m)^staged +0$`).MatchString(r.stdout) {
		t.Errorf("status output does not match %s and staged 0:\n%s", want, r.stdout)
	}
}

// A row with an infinite created_at (staged before migration 008) does not
// fail status: it is counted, and the oldest age is that of the finite
// rows (0 in a queue with none). The gem's table counts such a row poison.
func TestStatusInfiniteCreatedAt(t *testing.T) {
	t.Parallel()
	e := newRelayEnv(t)
	ctx := context.Background()
	table := pgx.Identifier{e.schema, "staged_jobs"}.Sanitize()
	if _, err := e.conn.Exec(ctx, `ALTER TABLE `+table+` DROP CONSTRAINT staged_jobs_created_at_finite;
		INSERT INTO `+table+` (job_name, job_args, queue, created_at) VALUES
			('A', '[]', 'default', now() - interval '90 seconds'),
			('Forever', '[]', 'default', 'infinity'),
			('Never', '[]', 'critical', '-infinity')`); err != nil {
		t.Fatal(err)
	}
	st := statusJSON(t, []string{"status", "--database-url", relaytest.DatabaseURL(), "--schema", e.schema})
	if st.Staged != 3 || st.OldestAge == nil || *st.OldestAge < 90 || *st.OldestAge > 120 || len(st.Queues) != 2 ||
		st.Queues[0] != (queueStatus{Queue: "critical", Staged: 1}) || st.Queues[1].Staged != 2 {
		t.Errorf("--json = %+v (oldest %v), want 3 staged, critical 1 of age 0, default 2, oldest 90-120s", st, st.OldestAge)
	}

	gem := pgx.Identifier{e.schema, "sidekiq_staged_push_jobs"}.Sanitize()
	if _, err := e.conn.Exec(ctx, `CREATE TABLE `+gem+` (id bigserial PRIMARY KEY, payload json NOT NULL,
			created_at timestamp(6) NOT NULL, updated_at timestamp(6) NOT NULL);
		INSERT INTO `+gem+` (payload, created_at, updated_at) VALUES
			('{"class":"A","args":[1]}', now() AT TIME ZONE 'UTC' - interval '1 minute', now() AT TIME ZONE 'UTC'),
			('{"class":"A","args":[2]}', 'infinity', now() AT TIME ZONE 'UTC'),
			('{"class":"A","args":[3]}', '-infinity', now() AT TIME ZONE 'UTC')`); err != nil {
		t.Fatal(err)
	}
	st = statusJSON(t, []string{"status", "--database-url", relaytest.DatabaseURL(), "--schema", e.schema, "--source", "sidekiq_staged_push"})
	if st.Staged != 3 || st.Poison == nil || *st.Poison != 2 || len(st.Queues) != 1 || st.Queues[0].Staged != 1 ||
		st.Queues[0].OldestAge < 55 || st.Queues[0].OldestAge > 120 {
		t.Errorf("--json --source sidekiq_staged_push = %+v (poison %v), want 3 staged: default 1 about a minute old, poison 2", st, st.Poison)
	}
}

// statusJSON runs status --json with args and decodes its output.
func statusJSON(t *testing.T, args []string) schemaStatus {
	t.Helper()
	r := runCLI(append(args, "--json")...)
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("status --json: exit %d, stderr %q; want 0 and nothing", r.code, r.stderr)
	}
	var st schemaStatus
	if err := json.Unmarshal([]byte(r.stdout), &st); err != nil {
		t.Fatalf("status --json printed %q: %v", r.stdout, err)
	}
	return st
}

// status on a schema without staged_jobs says to migrate, exit 1.
func TestStatusNotMigrated(t *testing.T) {
	t.Parallel()
	r := runCLI("status", "--database-url", relaytest.DatabaseURL(), "--schema", testSchema(t))
	checkOneLineError(t, r, 1, "does not exist", "stagedrain migrate")
}
