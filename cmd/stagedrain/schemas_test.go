package main

import (
	"context"
	"encoding/json"
	"errors"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// testSchemas returns a prefix no other test uses, and for each suffix the
// schema prefix+suffix (not created), all dropped when the test ends.
func testSchemas(t *testing.T, suffixes ...string) (string, []string) {
	t.Helper()
	base := testSchema(t)
	var schemas []string
	for _, s := range suffixes {
		schemas = append(schemas, relaytest.SchemaNamed(t, relaytest.DatabaseURL(), base+s))
	}
	return base, schemas
}

// execSQL runs sql on conn, failing the test if it fails.
func execSQL(t *testing.T, conn *pgx.Conn, sql string) {
	t.Helper()
	if _, err := conn.Exec(context.Background(), sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

// logLines decodes a command's JSON log lines with message msg.
func logLines(t *testing.T, stdout, msg string) []map[string]any {
	t.Helper()
	var found []map[string]any
	for _, l := range lines(stdout) {
		var fields map[string]any
		if err := json.Unmarshal([]byte(l), &fields); err != nil {
			t.Fatalf("a log line is not JSON: %q (%v)", l, err)
		}
		if fields["msg"] == msg {
			found = append(found, fields)
		}
	}
	return found
}

// linesBySchema maps the "schema" field of each line to the line.
func linesBySchema(ls []map[string]any) map[string]map[string]any {
	m := make(map[string]map[string]any)
	for _, l := range ls {
		s, _ := l["schema"].(string)
		m[s] = l
	}
	return m
}

// migrate --schemas migrates each name (creating it) and each existing
// schema a pattern matches, one "migrated" line each; a pattern that
// matches nothing is a warning; other schemas are left alone; a second run
// applies nothing.
func TestMigrateSchemas(t *testing.T) {
	t.Parallel()
	conn := testConn(t)
	base, s := testSchemas(t, "_a", "_b", "n", "o")
	a, b, named, other := s[0], s[1], s[2], s[3]
	execSQL(t, conn, "CREATE SCHEMA "+pgx.Identifier{a}.Sanitize()+"; CREATE SCHEMA "+pgx.Identifier{b}.Sanitize()+
		"; CREATE SCHEMA "+pgx.Identifier{other}.Sanitize())
	list := named + ", " + base + "_*," + base + "_zz*"
	args := []string{"migrate", "--database-url", relaytest.DatabaseURL(), "--schemas", list}

	r := runCLI(args...)
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("migrate --schemas: exit %d, stderr %q; want 0 and nothing", r.code, r.stderr)
	}
	got := linesBySchema(logLines(t, r.stdout, "migrated"))
	if len(got) != 3 || got[a] == nil || got[b] == nil || got[named] == nil {
		t.Fatalf("migrated lines for %v, want %s, %s and %s:\n%s", slices.Collect(mapKeys(got)), a, b, named, r.stdout)
	}
	for _, schema := range []string{a, b, named} {
		l := got[schema]
		applied, _ := l["applied"].([]any)
		if l["level"] != "info" || l["version"] == nil || !slices.Contains(applied, any("baseline_009.sql")) {
			t.Errorf("migrated line of %s = %v, want info, a version, baseline_009.sql applied", schema, l)
		}
		if !tableExists(t, conn, schema, "staged_jobs") {
			t.Errorf("%s.staged_jobs does not exist after migrate --schemas", schema)
		}
	}
	if tableExists(t, conn, other, "staged_jobs") {
		t.Errorf("%s, which no item names, was migrated", other)
	}
	warns := logLines(t, r.stdout, "no schema matches the pattern")
	if len(warns) != 1 || warns[0]["pattern"] != base+"_zz*" || warns[0]["level"] != "warn" {
		t.Errorf("warnings %v, want one for the pattern %s_zz*:\n%s", warns, base, r.stdout)
	}

	r = runCLI(args...)
	if r.code != 0 {
		t.Fatalf("second migrate --schemas: exit %d, stderr %q", r.code, r.stderr)
	}
	again := logLines(t, r.stdout, "migrated")
	if len(again) != 3 {
		t.Fatalf("second run: %d migrated lines, want 3:\n%s", len(again), r.stdout)
	}
	for _, l := range again {
		if applied, ok := l["applied"].([]any); !ok || len(applied) != 0 {
			t.Errorf("second run applied %v to %v, want []", l["applied"], l["schema"])
		}
	}

	// Patterns that match nothing, and nothing else: an error.
	r = runCLI("migrate", "--database-url", relaytest.DatabaseURL(), "--schemas", base+"_zz*")
	checkOneLineError(t, r, 1, "no schema matches", base+"_zz*")
}

func mapKeys[M ~map[K]V, K comparable, V any](m M) func(func(K) bool) {
	return func(yield func(K) bool) {
		for k := range m {
			if !yield(k) {
				return
			}
		}
	}
}

// With --source sidekiq_staged_push, a pattern matches only the schemas
// holding the gem's table; a schema that fails (a name without the table)
// is logged, the others are migrated, and the exit is 1 with one line
// naming it.
func TestMigrateSchemasFailure(t *testing.T) {
	t.Parallel()
	conn := testConn(t)
	base, s := testSchemas(t, "_a", "_g1", "_g2")
	missing, g1, g2 := s[0], s[1], s[2]
	execSQL(t, conn, "CREATE SCHEMA "+pgx.Identifier{g1}.Sanitize()+"; CREATE SCHEMA "+pgx.Identifier{g2}.Sanitize())
	execSQL(t, conn, gemTableSQL(t, g1))

	r := runCLI("migrate", "--database-url", relaytest.DatabaseURL(), "--source", "sidekiq_staged_push",
		"--schemas", missing+","+base+"_*")
	checkOneLineError(t, r, 1, "1 of 2 schemas failed", missing)
	if strings.Contains(r.stderr, g1) || strings.Contains(r.stderr, g2) {
		t.Errorf("stderr %q names a schema that did not fail", r.stderr)
	}
	failed := logLines(t, r.stdout, "migrate failed")
	if len(failed) != 1 || failed[0]["schema"] != missing || failed[0]["level"] != "error" || failed[0]["error"] == "" {
		t.Errorf("migrate failed lines %v, want one at error for %s", failed, missing)
	}
	ok := logLines(t, r.stdout, "migrated")
	if len(ok) != 1 || ok[0]["schema"] != g1 || ok[0]["source"] != "sidekiq_staged_push" {
		t.Fatalf("migrated lines %v, want one for %s (source sidekiq_staged_push), after %s failed:\n%s", ok, g1, missing, r.stdout)
	}
	var triggers int
	if err := conn.QueryRow(context.Background(), `SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal
		AND tgrelid = to_regclass($1)`, pgx.Identifier{g1, "sidekiq_staged_push_jobs"}.Sanitize()).Scan(&triggers); err != nil {
		t.Fatal(err)
	}
	if triggers == 0 {
		t.Errorf("%s.sidekiq_staged_push_jobs has no trigger after migrate", g1)
	}
	if tableExists(t, conn, g2, "staged_jobs") || tableExists(t, conn, g2, "sidekiq_staged_push_jobs") {
		t.Errorf("%s, without the gem's table, was touched", g2)
	}
}

// --schemas is a list: --schema with it, an empty item or an empty list is
// a usage error, for migrate and status alike.
func TestSchemasUsage(t *testing.T) {
	t.Parallel()
	db := relaytest.DatabaseURL()
	for _, cmd := range []string{"migrate", "status"} {
		for _, tt := range []struct {
			name string
			args []string
			want []string
		}{
			{"with --schema", []string{"--schema", "a", "--schemas", "b,c"}, []string{cmd + ": --schema and --schemas cannot be used together"}},
			{"empty item", []string{"--schemas", "a,,b"}, []string{cmd + ": --schemas", "empty item"}},
			{"empty", []string{"--schemas="}, []string{"--schemas must not be empty"}},
			{"twice", []string{"--schemas", "a,a"}, []string{cmd + ": --schemas", `names "a" twice`}},
		} {
			t.Run(cmd+" "+tt.name, func(t *testing.T) {
				t.Parallel()
				checkUsageError(t, runCLI(append([]string{cmd, "--database-url", db}, tt.args...)...), tt.want...)
			})
		}
	}
}

// $STAGEDRAIN_SCHEMA with --schemas is a usage error too, naming the
// variable.
func TestSchemasUsageEnv(t *testing.T) {
	// Not parallel: t.Setenv.
	t.Setenv("STAGEDRAIN_SCHEMA", "a")
	r := runCLI("migrate", "--database-url", relaytest.DatabaseURL(), "--schemas", "b")
	checkUsageError(t, r, "$STAGEDRAIN_SCHEMA (--schema) and --schemas cannot be used together")
}

// status --schemas shows a block per matching schema (those holding
// staged_jobs), each with its own backlog; --json, an array. A name
// without the table is shown with its error, and exits 1 naming it.
func TestStatusSchemas(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	conn := testConn(t)
	base, s := testSchemas(t, "_a", "_b", "_c")
	a, b, c := s[0], s[1], s[2]
	for _, schema := range []string{a, b} {
		if _, err := relay.Migrate(ctx, conn, schema); err != nil {
			t.Fatal(err)
		}
	}
	execSQL(t, conn, "CREATE SCHEMA "+pgx.Identifier{c}.Sanitize())
	execSQL(t, conn, `INSERT INTO `+pgx.Identifier{a, "staged_jobs"}.Sanitize()+` (job_name, job_args, queue) VALUES
		('A', '[]', 'default'), ('B', '[]', 'default'), ('C', '[]', 'critical')`)
	execSQL(t, conn, `INSERT INTO `+pgx.Identifier{b, "staged_jobs"}.Sanitize()+` (job_name, job_args, queue) VALUES ('D', '[]', 'mail')`)
	args := []string{"status", "--database-url", relaytest.DatabaseURL(), "--schemas", base + "_*"}

	r := runCLI(append(args, "--json")...)
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("status --schemas --json: exit %d, stderr %q", r.code, r.stderr)
	}
	var sts []schemaStatus
	if err := json.Unmarshal([]byte(r.stdout), &sts); err != nil {
		t.Fatalf("status --schemas --json printed %q: %v", r.stdout, err)
	}
	if len(sts) != 2 || sts[0].Schema != a || sts[0].Staged != 3 || len(sts[0].Queues) != 2 ||
		sts[1].Schema != b || sts[1].Staged != 1 || len(sts[1].Queues) != 1 || sts[1].Queues[0].Queue != "mail" {
		t.Fatalf("status --schemas --json = %+v, want %s with 3 staged in 2 queues, %s with 1 in mail", sts, a, b)
	}
	if strings.Contains(r.stdout, `"paused"`) {
		t.Errorf("without --redis-url, status shows pauses:\n%s", r.stdout)
	}

	r = runCLI(args...)
	if r.code != 0 || r.stderr != "" {
		t.Fatalf("status --schemas: exit %d, stderr %q", r.code, r.stderr)
	}
	blocks := strings.Split(r.stdout, "\n\nschema ")
	if len(blocks) != 2 ||
		!regexp.MustCompile(`^schema +`+regexp.QuoteMeta(a)+`\nstaged +3, oldest `).MatchString(blocks[0]) ||
		!regexp.MustCompile(`(?m)^critical +1 `).MatchString(blocks[0]) ||
		!regexp.MustCompile(`^ *`+regexp.QuoteMeta(b)+`\nstaged +1, oldest `).MatchString(blocks[1]) ||
		!regexp.MustCompile(`(?m)^mail +1 `).MatchString(blocks[1]) {
		t.Errorf("status --schemas output is not a block for %s then one for %s:\n%s", a, b, r.stdout)
	}

	// A name without staged_jobs: its error, in its place.
	r = runCLI("status", "--database-url", relaytest.DatabaseURL(), "--json", "--schemas", c+","+base+"_*")
	checkOneLineError(t, r, 1, "1 of 3 schemas could not be read", c)
	var outs []map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &outs); err != nil {
		t.Fatalf("status --json printed %q: %v", r.stdout, err)
	}
	if len(outs) != 3 || outs[2]["schema"] != c || !strings.Contains(outs[2]["error"].(string), "stagedrain migrate") ||
		outs[0]["staged"] != float64(3) {
		t.Errorf("status --json = %v, want %s, %s, then %s with an error saying to migrate", outs, a, b, c)
	}

	r = runCLI("status", "--database-url", relaytest.DatabaseURL(), "--schemas", base+"_zz*")
	if r.code != 1 || !strings.Contains(r.stderr, "no schema holding staged_jobs matches") {
		t.Errorf("status --schemas matching nothing: exit %d, stderr %q; want 1 and no schema matches", r.code, r.stderr)
	}

	// With the gem's source, patterns match the schemas holding its table.
	g := relaytest.SchemaNamed(t, relaytest.DatabaseURL(), base+"_g")
	execSQL(t, conn, "CREATE SCHEMA "+pgx.Identifier{g}.Sanitize())
	execSQL(t, conn, gemTableSQL(t, g))
	r = runCLI("status", "--database-url", relaytest.DatabaseURL(), "--source", "sidekiq_staged_push", "--json", "--schemas", base+"_*")
	if err := json.Unmarshal([]byte(r.stdout), &sts); r.code != 0 || err != nil || len(sts) != 1 || sts[0].Schema != g {
		t.Errorf("status --source sidekiq_staged_push --schemas: exit %d (stderr %q), %+v; want only %s", r.code, r.stderr, sts, g)
	}
}

// With --redis-url, status shows the queues the leader pauses for
// backpressure (from the Redis hash the leader writes), and none once the
// pause ended; without it, nothing about pauses; with a Redis that does
// not answer, the rest and "unknown", exit 1.
func TestStatusPaused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	e := newRelayEnv(t)
	inProcessRelay(t, "--database-url", relaytest.DatabaseURL(), "--schema", e.schema,
		"--redis-url", relaytest.RedisURL(), "--redis-namespace", e.ns, "--metrics-addr", "",
		"--max-queue-length", "2", "--batch-size", "1")
	e.stage("PausedJob", 5)
	args := []string{"status", "--database-url", relaytest.DatabaseURL(), "--schema", e.schema,
		"--redis-url", relaytest.RedisURL(), "--redis-namespace", e.ns}
	pausedOf := func(args []string) (any, string) {
		r := runCLI(append(args, "--json")...)
		if r.code != 0 || r.stderr != "" {
			t.Fatalf("status --json: exit %d, stderr %q", r.code, r.stderr)
		}
		var out map[string]any
		if err := json.Unmarshal([]byte(r.stdout), &out); err != nil {
			t.Fatalf("status --json printed %q: %v", r.stdout, err)
		}
		b, _ := json.Marshal(out["paused"])
		return out["paused"], string(b)
	}
	relaytest.WaitFor(t, 15*time.Second, "status to show queue default paused", func() (bool, string) {
		_, s := pausedOf(args)
		return s == `[{"queue":"default","reason":"queue_length"}]`, s
	})
	r := runCLI(args...)
	if r.code != 0 || !regexp.MustCompile(`(?m)^paused +default \(queue_length\)$`).MatchString(r.stdout) {
		t.Errorf("status: exit %d, stdout:\n%s\nwant a line paused default (queue_length)", r.code, r.stdout)
	}
	// --schemas too.
	r = runCLI("status", "--database-url", relaytest.DatabaseURL(), "--schemas", e.schema, "--json",
		"--redis-url", relaytest.RedisURL(), "--redis-namespace", e.ns)
	var outs []statusOut
	if err := json.Unmarshal([]byte(r.stdout), &outs); err != nil || len(outs) != 1 || outs[0].Paused == nil ||
		!slices.Equal(*outs[0].Paused, []pausedQueue{{Queue: "default", Reason: "queue_length"}}) {
		t.Errorf("status --schemas --json: exit %d, %s; want default paused", r.code, r.stdout)
	}
	// Without Redis: no word of pauses.
	if p, s := pausedOf([]string{"status", "--database-url", relaytest.DatabaseURL(), "--schema", e.schema, "--redis-url="}); p != nil {
		t.Errorf("status without --redis-url shows paused %s", s)
	}
	if r := runCLI("status", "--database-url", relaytest.DatabaseURL(), "--schema", e.schema, "--redis-url="); strings.Contains(r.stdout, "paused") {
		t.Errorf("status without --redis-url shows pauses:\n%s", r.stdout)
	}
	// A Redis that does not answer: the rest is shown, and the error.
	r = runCLI("status", "--database-url", relaytest.DatabaseURL(), "--schema", e.schema, "--redis-url", "redis://:s3cretpw@127.0.0.1:1/0")
	checkOneLineError(t, r, 1, "127.0.0.1:1")
	if !regexp.MustCompile(`(?m)^paused +unknown`).MatchString(r.stdout) || !regexp.MustCompile(`(?m)^staged +`).MatchString(r.stdout) ||
		strings.Contains(r.stdout+r.stderr, "s3cretpw") {
		t.Errorf("status with Redis down: stdout\n%s\nwant the backlog and paused unknown, no password", r.stdout)
	}

	// A consumer empties the queue until the relay has delivered every job:
	// the pause ends, and status says none. (Each pop lets the relay push
	// more and pause again, so only the end, nothing staged, is stable.)
	relaytest.WaitFor(t, 15*time.Second, "the relay to drain, and status to show no pause", func() (bool, string) {
		for {
			if _, err := e.rdb.RPop(ctx, e.ns+":queue:default").Result(); errors.Is(err, redis.Nil) {
				break
			} else if err != nil {
				return false, err.Error()
			}
		}
		r := runCLI(args...)
		return r.code == 0 && regexp.MustCompile(`(?m)^staged +0$`).MatchString(r.stdout) &&
			regexp.MustCompile(`(?m)^paused +none$`).MatchString(r.stdout), r.stdout
	})
	if _, s := pausedOf(args); s != `[]` {
		t.Errorf("status --json after the pause ended: paused %s, want []", s)
	}
}

// status's Redis flags are checked before it connects to anything: a URL
// that cannot be parsed (never echoed) and an unknown mode are usage errors.
func TestStatusRedisUsage(t *testing.T) {
	t.Parallel()
	db := relaytest.DatabaseURL()
	for _, tt := range []struct {
		name string
		args []string
		want []string
	}{
		{"bad url", []string{"--redis-url", "http://:s3cretpw@h"}, []string{"status: --redis-url cannot be parsed"}},
		{"bad cluster url", []string{"--redis-mode", "cluster", "--redis-url", "http://:s3cretpw@h:1"}, []string{"status: --redis-url cannot be parsed as a cluster URL"}},
		{"sentinel without master", []string{"--redis-mode", "sentinel", "--redis-url", "redis://:s3cretpw@h:26379/0"}, []string{"status: --redis-url cannot be parsed as a sentinel URL"}},
		{"unknown mode", []string{"--redis-mode", "ring", "--redis-url", "redis://h:1/0"}, []string{"status: --redis-mode must be single, cluster or sentinel", `"ring"`}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			r := runCLI(append([]string{"status", "--database-url", db}, tt.args...)...)
			checkUsageError(t, r, tt.want...)
			if strings.Contains(r.stderr, "s3cretpw") {
				t.Errorf("the password shows: %q", r.stderr)
			}
		})
	}
}

// status --redis-mode cluster reads the paused queues from a Redis
// Cluster, where the leader writes them as anywhere else: one hash, in the
// slot of its key.
func TestStatusPausedOnRedisCluster(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const password = "cluster-s3cret"
	cluster := relaytest.StartRedisCluster(t, "--requirepass", password, "--masterauth", password)
	var addrs []string
	for _, n := range cluster.Nodes {
		addrs = append(addrs, "127.0.0.1:"+strconv.Itoa(n.Port))
	}
	url := "redis://:" + password + "@" + addrs[0] + "?addr=" + addrs[1] + "&addr=" + addrs[2]
	o, err := redis.ParseClusterURL(url)
	if err != nil {
		t.Fatal(err)
	}
	o.DisableIdentity = true
	rdb := redis.NewClusterClient(o)
	defer rdb.Close()
	e := newRelayEnv(t)
	db := e.conn.Config().Database
	// The hash a leader writes (relay's TestBackpressurePublished checks
	// its name).
	key := e.ns + ":stagedrain:" + db + ":" + e.schema + ":paused"
	if err := rdb.HSet(ctx, key, "*", "memory", "mail", "queue_length").Err(); err != nil {
		t.Fatal(err)
	}
	r := runCLI("status", "--database-url", relaytest.DatabaseURL(), "--schema", e.schema,
		"--redis-mode", "cluster", "--redis-url", url, "--redis-namespace", e.ns)
	if r.code != 0 || r.stderr != "" ||
		!regexp.MustCompile(`(?m)^paused +\* \(every queue\) \(memory\)\npaused +mail \(queue_length\)$`).MatchString(r.stdout) {
		t.Errorf("status --redis-mode cluster: exit %d, stderr %q, stdout:\n%s\nwant * (memory) and mail paused", r.code, r.stderr, r.stdout)
	}
	if strings.Contains(r.stdout+r.stderr, password) {
		t.Errorf("the password shows")
	}
}
