package main

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// deadCount counts the rows of schema's staged_jobs_dead.
func deadCount(t *testing.T, conn *pgx.Conn, schema string) int {
	t.Helper()
	var n int
	if err := conn.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{schema, "staged_jobs_dead"}.Sanitize()).Scan(&n); err != nil {
		t.Fatalf("count staged_jobs_dead: %v", err)
	}
	return n
}

// A job Redis refuses (WRONGTYPE) is dead-lettered by the relay; dead list
// shows it, dead retry of an id that is not dead changes nothing, and once
// the key is fixed dead retry moves it back and the relay delivers it with
// the same jid.
func TestDeadListAndRetry(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema, conn := testSchema(t), testConn(t)
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		t.Fatal(err)
	}
	rdb, ns := relaytest.Redis(t)
	if err := rdb.Set(ctx, ns+":queue:broken", "not a list", 0).Err(); err != nil {
		t.Fatal(err)
	}
	jid, err := relay.NewStager(schema).Stage(ctx, conn, relay.Job{Name: "Bounced", Queue: "broken", Args: []any{7}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := relay.New(relay.Config{DatabaseURL: relaytest.DatabaseURL(), Redis: rdb, Schema: schema, RedisNamespace: ns, PollInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run = %v, want nil after cancel", err)
		}
	})
	relaytest.WaitFor(t, 10*time.Second, "the job in staged_jobs_dead", func() (bool, string) {
		n := deadCount(t, conn, schema)
		return n == 1, fmt.Sprintf("%d dead rows, %d staged", n, stagedCount(t, conn, schema))
	})
	db := []string{"--database-url", relaytest.DatabaseURL(), "--schema", schema}

	res := runCLI(append([]string{"dead", "list"}, db...)...)
	if res.code != 0 || res.stderr != "" {
		t.Fatalf("dead list: exit %d, stderr %q; want 0 and nothing", res.code, res.stderr)
	}
	ls := lines(res.stdout)
	if len(ls) != 2 || !strings.HasPrefix(ls[0], "ID") || !strings.Contains(ls[1], jid) || !strings.Contains(ls[1], "Bounced") ||
		!strings.Contains(ls[1], "broken") || !strings.Contains(ls[1], "WRONGTYPE") {
		t.Fatalf("dead list printed\n%s\nwant a header and one row with jid %s, Bounced, broken and WRONGTYPE", res.stdout, jid)
	}
	res = runCLI(append([]string{"dead", "list", "--json"}, db...)...)
	var rows []map[string]any
	if err := json.Unmarshal([]byte(res.stdout), &rows); err != nil || res.code != 0 {
		t.Fatalf("dead list --json: exit %d, %v; stdout %q", res.code, err, res.stdout)
	}
	if len(rows) != 1 || rows[0]["jid"] != jid || rows[0]["queue"] != "broken" || rows[0]["attempts"] != float64(1) ||
		!strings.Contains(fmt.Sprint(rows[0]["reason"]), "WRONGTYPE") || fmt.Sprint(rows[0]["job_args"]) != "[7]" {
		t.Fatalf("dead list --json = %v, want one object with jid %s, queue broken, job_args [7], attempts 1, a WRONGTYPE reason", rows, jid)
	}
	id := strconv.FormatInt(int64(rows[0]["id"].(float64)), 10)

	res = runCLI(append([]string{"dead", "retry", id, "999999"}, db...)...)
	checkOneLineError(t, res, 1, "dead retry", "no dead row with id 999999", "nothing changed")
	if n := deadCount(t, conn, schema); n != 1 {
		t.Fatalf("%d dead rows after a failed retry, want 1 (nothing moved)", n)
	}

	if err := rdb.Del(ctx, ns+":queue:broken").Err(); err != nil {
		t.Fatal(err)
	}
	res = runCLI(append([]string{"dead", "retry", id}, db...)...)
	if res.code != 0 || res.stderr != "" || res.stdout != "moved 1 dead row back into staged_jobs\n" {
		t.Fatalf("dead retry %s: exit %d, stdout %q, stderr %q; want 0 and \"moved 1 dead row back into staged_jobs\"", id, res.code, res.stdout, res.stderr)
	}
	relaytest.WaitFor(t, 10*time.Second, "the retried job in queue:broken", func() (bool, string) {
		got, err := rdb.LRange(ctx, ns+":queue:broken", 0, -1).Result()
		return len(got) == 1 && strings.Contains(got[0], `"jid":"`+jid+`"`), fmt.Sprint(got, err)
	})
	if n := deadCount(t, conn, schema); n != 0 {
		t.Fatalf("%d dead rows after retry, want 0", n)
	}
}

// dead purge deletes by id, by age or all; an id that is not dead fails it
// and deletes nothing.
func TestDeadPurge(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema, conn := testSchema(t), testConn(t)
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		t.Fatal(err)
	}
	dead := pgx.Identifier{schema, "staged_jobs_dead"}.Sanitize()
	if _, err := conn.Exec(ctx, "INSERT INTO "+dead+` (id, job_name, job_args, queue, jid, created_at, options, reason, failed_at, attempts) VALUES
		(1, 'Old', '[]', 'default', 'aaaaaaaaaaaaaaaaaaaaaaaa', now(), '{}', 'WRONGTYPE', now() - interval '8 days', 1),
		(2, 'Recent', '[]', 'default', 'bbbbbbbbbbbbbbbbbbbbbbbb', now(), '{}', 'WRONGTYPE', now() - interval '1 day', 1),
		(3, 'New', '[]', 'default', 'cccccccccccccccccccccccc', now(), '{}', 'WRONGTYPE', now(), 1),
		(4, 'Newer', '[]', 'default', 'dddddddddddddddddddddddd', now(), '{}', 'WRONGTYPE', now(), 1)`); err != nil {
		t.Fatal(err)
	}
	db := []string{"--database-url", relaytest.DatabaseURL(), "--schema", schema}
	purge := func(want string, args ...string) {
		t.Helper()
		res := runCLI(append(append([]string{"dead", "purge"}, args...), db...)...)
		if res.code != 0 || res.stderr != "" || res.stdout != want {
			t.Fatalf("dead purge %v: exit %d, stdout %q, stderr %q; want 0 and %q", args, res.code, res.stdout, res.stderr, want)
		}
	}
	purge("purged 1 dead row\n", "--older-than", "7d")
	if n := deadCount(t, conn, schema); n != 3 {
		t.Fatalf("%d dead rows after purge --older-than 7d, want 3", n)
	}
	purge("purged 1 dead row\n", "--older-than", "12h")
	checkOneLineError(t, runCLI(append([]string{"dead", "purge", "3", "77"}, db...)...), 1, "no dead row with id 77")
	if n := deadCount(t, conn, schema); n != 2 {
		t.Fatalf("%d dead rows after a failed purge, want 2 (nothing deleted)", n)
	}
	purge("purged 1 dead row\n", "3")
	purge("purged 1 dead row\n", "--all")
	purge("purged 0 dead rows\n", "--all")
	res := runCLI(append([]string{"dead", "list", "--json"}, db...)...)
	if res.code != 0 || strings.TrimSpace(res.stdout) != "[]" {
		t.Fatalf("dead list --json after purge --all: exit %d, stdout %q; want []", res.code, res.stdout)
	}
}

// A database failure exits 1 with one line: here a schema that was never
// migrated, so has no staged_jobs_dead.
func TestDeadDatabaseError(t *testing.T) {
	t.Parallel()
	schema := testSchema(t)
	for _, sub := range [][]string{{"list"}, {"retry", "--all"}, {"purge", "--all"}} {
		res := runCLI(append(append([]string{"dead"}, sub...), "--database-url", relaytest.DatabaseURL(), "--schema", schema)...)
		checkOneLineError(t, res, 1, "dead "+sub[0], "staged_jobs_dead", "does not exist")
	}
}

// A row dead of an infinite run_at or created_at (staged before migration
// 008 refused them) is listed, its values printed as "infinity" and
// "-infinity" by list --json; dead retry of it fails naming a 008
// constraint and moves nothing, until its times are fixed.
func TestDeadInfiniteTimes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	schema, conn := testSchema(t), testConn(t)
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		t.Fatal(err)
	}
	dead := pgx.Identifier{schema, "staged_jobs_dead"}.Sanitize()
	if _, err := conn.Exec(ctx, "INSERT INTO "+dead+` (id, job_name, job_args, queue, run_at, jid, created_at, options, reason, attempts) VALUES
		(1, 'Forever', '[]', 'default', 'infinity', 'aaaaaaaaaaaaaaaaaaaaaaaa', '-infinity', '{}', 'run_at is infinity: Go and the job systems cannot hold it', 1)`); err != nil {
		t.Fatal(err)
	}
	db := []string{"--database-url", relaytest.DatabaseURL(), "--schema", schema}
	res := runCLI(append([]string{"dead", "list"}, db...)...)
	if res.code != 0 || res.stderr != "" || !strings.Contains(res.stdout, "Forever") {
		t.Fatalf("dead list: exit %d, stdout %q, stderr %q; want 0 and the row", res.code, res.stdout, res.stderr)
	}
	res = runCLI(append([]string{"dead", "list", "--json"}, db...)...)
	var rows []map[string]any
	if err := json.Unmarshal([]byte(res.stdout), &rows); err != nil || res.code != 0 {
		t.Fatalf("dead list --json: exit %d, %v; stdout %q, stderr %q", res.code, err, res.stdout, res.stderr)
	}
	if len(rows) != 1 || rows[0]["run_at"] != "infinity" || rows[0]["created_at"] != "-infinity" {
		t.Fatalf("dead list --json = %v, want run_at \"infinity\", created_at \"-infinity\"", rows)
	}
	checkOneLineError(t, runCLI(append([]string{"dead", "retry", "1"}, db...)...), 1, "dead retry", "violates check constraint \"staged_jobs_created_at_finite\"")
	if n := deadCount(t, conn, schema); n != 1 {
		t.Fatalf("%d dead rows after a refused retry, want 1 (nothing moved)", n)
	}
}
