package main

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// migrate --source sidekiq_staged_push adds the wake trigger to the gem's
// table, again and again without change, and refuses a schema without that
// table; run with that source refuses, with exit 1 and one line, a table
// without the trigger, naming the command to run.
func TestMigrateAndRunSidekiqStagedPushSource(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := testSchema(t)
	conn := testConn(t)
	args := []string{"migrate", "--database-url", relaytest.DatabaseURL(), "--schema", schema, "--source", "sidekiq_staged_push"}

	checkOneLineError(t, runCLI(args...), 1, "no table", "sidekiq_staged_push_jobs", "install sidekiq-staged_push")

	quoted := pgx.Identifier{schema}.Sanitize()
	if _, err := conn.Exec(ctx, `CREATE SCHEMA `+quoted+`;`+gemTableSQL(t, schema)); err != nil {
		t.Fatal(err)
	}

	_, ns := relaytest.Redis(t)
	p := startProc(t, "relay", childEnv(), "run", "--schema", schema, "--redis-namespace", ns, "--source", "sidekiq_staged_push")
	if code := p.wait(15 * time.Second); code != 1 {
		t.Fatalf("run before migrate: exit code %d, want 1; output:\n%s", code, p.output())
	}
	if stderr := p.stderr.snapshot(); len(stderr) != 1 ||
		!strings.Contains(stderr[0].raw, "run 'stagedrain migrate --source sidekiq_staged_push' first") {
		t.Fatalf("run before migrate: stderr %q, want one line naming 'stagedrain migrate --source sidekiq_staged_push'", p.output())
	}

	first := checkMigrated(t, runCLI(args...), schema)
	second := checkMigrated(t, runCLI(args...), schema)
	if a, _ := first["applied"].([]any); len(a) != 3 {
		t.Errorf("first migrate applied %v, want the wake function and trigger, and the xid-first trigger", first["applied"])
	}
	if a, ok := second["applied"].([]any); !ok || len(a) != 0 {
		t.Errorf("second migrate applied %v, want []", second["applied"])
	}
	if tableExists(t, conn, schema, "staged_jobs") || tableExists(t, conn, schema, "stagedrain_migrations") {
		t.Errorf("migrate --source sidekiq_staged_push created stagedrain's tables")
	}
	var n int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_trigger WHERE tgrelid = $1::regclass AND tgname = 'stagedrain_wake'`,
		pgx.Identifier{schema, "sidekiq_staged_push_jobs"}.Sanitize()).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d stagedrain_wake triggers (%v), want 1", n, err)
	}
}

// status --source sidekiq_staged_push counts the gem's table by the queue
// the relay would push each row to, and its poison rows apart.
func TestStatusSidekiqStagedPushSource(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema := testSchema(t)
	conn := testConn(t)
	quoted := pgx.Identifier{schema}.Sanitize()
	if _, err := conn.Exec(ctx, `CREATE SCHEMA `+quoted+`;`+gemTableSQL(t, schema)+`
		INSERT INTO `+quoted+`.sidekiq_staged_push_jobs (payload, created_at, updated_at) VALUES
			('{"class":"A","args":[1]}', now() AT TIME ZONE 'UTC' - interval '1 minute', now() AT TIME ZONE 'UTC'),
			('{"class":"A","args":[2],"queue":"default"}', now() AT TIME ZONE 'UTC', now() AT TIME ZONE 'UTC'),
			('{"class":"B","args":[],"queue":"critical","at":1.5}', now() AT TIME ZONE 'UTC', now() AT TIME ZONE 'UTC'),
			('[1]', now() AT TIME ZONE 'UTC', now() AT TIME ZONE 'UTC'),
			('{"class":"C","args":[],"at":null}', now() AT TIME ZONE 'UTC', now() AT TIME ZONE 'UTC')`); err != nil {
		t.Fatal(err)
	}
	r := runCLI("status", "--database-url", relaytest.DatabaseURL(), "--schema", schema, "--source", "sidekiq_staged_push", "--json")
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("status: exit %d, stderr %q", r.code, r.stderr)
	}
	var st schemaStatus
	if err := json.Unmarshal([]byte(r.stdout), &st); err != nil {
		t.Fatalf("status --json: %v: %s", err, r.stdout)
	}
	if st.Staged != 5 || st.Poison == nil || *st.Poison != 2 || st.Dead != nil || len(st.Queues) != 2 ||
		st.Queues[0] != (queueStatus{Queue: "critical", Staged: 1, OldestAge: st.Queues[0].OldestAge}) ||
		st.Queues[1].Queue != "default" || st.Queues[1].Staged != 2 {
		t.Fatalf("status %+v (poison %v), want 5 staged: critical 1, default 2, poison 2, dead null", st, st.Poison)
	}
	if a := st.Queues[1].OldestAge; a < 55 || a > 120 {
		t.Errorf("default's oldest age %fs, want about a minute (created_at is UTC)", a)
	}
	r = runCLI("status", "--database-url", relaytest.DatabaseURL(), "--schema", schema, "--source", "sidekiq_staged_push")
	if r.code != 0 || !strings.Contains(r.stdout, "poison") {
		t.Errorf("status: exit %d, stdout %q, want a poison line", r.code, r.stdout)
	}
}

// gemTableSQL creates the sidekiq-staged_push gem's table
// (../../testdata/sidekiq_staged_push_jobs.sql) in schema, which exists.
func gemTableSQL(t *testing.T, schema string) string {
	b, err := os.ReadFile("../../testdata/sidekiq_staged_push_jobs.sql")
	if err != nil {
		t.Fatal(err)
	}
	return "SET search_path TO " + pgx.Identifier{schema}.Sanitize() + ";\n" + string(b) + "RESET search_path;"
}
