package main

import (
	"context"
	"fmt"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// stageIn INSERTs a job for queue default into schema's staged_jobs with
// plain SQL and returns its jid.
func (d *defaultsEnv) stageIn(schema string) string {
	d.t.Helper()
	var jid string
	err := d.conn.QueryRow(context.Background(),
		"INSERT INTO "+pgx.Identifier{schema, "staged_jobs"}.Sanitize()+" (job_name, job_args) VALUES ('TenantJob', '[1]') RETURNING jid").Scan(&jid)
	if err != nil {
		d.t.Fatalf("stage a job in %s: %v", schema, err)
	}
	return jid
}

// waitLines waits until p has logged msg n times.
func waitLines(t *testing.T, p *proc, msg string, n int) {
	t.Helper()
	relaytest.WaitFor(t, 20*time.Second, fmt.Sprintf("%d lines %q from %s", n, msg, p.name), func() (bool, string) {
		got := p.count(rootLogger, msg)
		return got >= n, fmt.Sprintf("%d lines; output:\n%s", got, p.output())
	})
}

// Two `stagedrain run --schemas tenant_*` on one host, with nothing else
// but DATABASE_URL and REDIS_URL: the first leads all four tenants, the
// second takes half of them, jobs of every tenant are delivered once, and
// when the second is SIGKILLed the first takes its tenants back.
func TestDefaultsFleetsOnOneHost(t *testing.T) {
	t.Parallel()
	d := newDefaultsEnv(t)
	var tenants []string
	for i := range 4 {
		s := fmt.Sprintf("tenant_%d", i)
		if _, err := relay.Migrate(context.Background(), d.conn, s); err != nil {
			t.Fatal(err)
		}
		tenants = append(tenants, s)
	}
	a := d.start("relay a", "--schemas", "tenant_*")
	waitLines(t, a, "became leader", 4)
	b := d.start("relay b", "--schemas", "tenant_*")
	waitLines(t, b, "became leader", 2)
	waitLines(t, a, "released leadership", 2)
	checkUp(t, a, b)
	var jids []string
	for _, s := range tenants {
		jids = append(jids, d.stageIn(s))
	}
	d.waitDelivered("default", jids...)

	b.signal(syscall.SIGKILL)
	if code := b.wait(10 * time.Second); code != -1 {
		t.Fatalf("relay b exited with code %d, want death by SIGKILL", code)
	}
	waitLines(t, a, "became leader", 6)
	for _, s := range tenants {
		jids = append(jids, d.stageIn(s))
	}
	d.waitDelivered("default", jids...)
	checkUp(t, a)
	checkAllJSON(t, a)
	if n := a.count(rootLogger, "stepped down"); n != 0 {
		t.Errorf("relay a stepped down %d times; output:\n%s", n, a.output())
	}
}

// --schemas refuses what cannot name schemas, and --schema beside it.
func TestRunSchemasFlag(t *testing.T) {
	t.Parallel()
	url := relaytest.DatabaseURL()
	checkUsageError(t, runCLI("run", "--database-url", url, "--schema", "a", "--schemas", "b"),
		"run: --schema and --schemas cannot be used together")
	checkUsageError(t, runCLI("run", "--database-url", url, "--schemas", "a,,b"),
		"run: --schemas must not hold an empty item")
	checkUsageError(t, runCLI("run", "--database-url", url, "--schemas", "a,a"),
		`run: --schemas names "a" twice`)
}

// run --migrate --schemas migrates the schemas the list names (created
// empty by the app, as a tenant's signup does) and drains them; one that
// cannot be migrated is logged, and the others drain.
func TestRunMigrateSchemas(t *testing.T) {
	t.Parallel()
	d := newDefaultsEnv(t)
	ctx := context.Background()
	for _, s := range []string{"tenant_a", "tenant_b"} {
		if _, err := d.conn.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{s}.Sanitize()); err != nil {
			t.Fatal(err)
		}
	}
	// A table of the same name that is not stagedrain's: its migration
	// fails, and the relay goes on with the others.
	if _, err := d.conn.Exec(ctx, `CREATE SCHEMA tenant_odd; CREATE TABLE tenant_odd.staged_jobs (id text)`); err != nil {
		t.Fatal(err)
	}
	p := d.start("relay", "--migrate", "--schemas", "tenant_*")
	waitLines(t, p, "became leader", 2)
	d.waitDelivered("default", d.stageIn("tenant_a"), d.stageIn("tenant_b"))
	if n := p.count(rootLogger, "migrate failed"); n != 1 {
		t.Errorf("%d lines \"migrate failed\", want 1 (tenant_odd); output:\n%s", n, p.output())
	}
	p.waitLog(rootLogger, "migrate did not migrate every schema; draining those that are", 5*time.Second)
	checkUp(t, p)
}
