package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

var jidRE = regexp.MustCompile(`^[0-9a-f]{24}$`)

// Log lines the process tests wait for, as logger and message.
const (
	rootLogger   = "stagedrain"
	drainLogger  = "stagedrain.drain"
	listenLogger = "stagedrain.listener"
)

// relayEnv is one test's schema (migrated) and Redis namespace.
type relayEnv struct {
	t      *testing.T
	schema string
	ns     string
	rdb    *redis.Client
	conn   *pgx.Conn
}

func newRelayEnv(t *testing.T) *relayEnv {
	t.Helper()
	e := &relayEnv{t: t, schema: testSchema(t), conn: testConn(t)}
	e.rdb, e.ns = relaytest.Redis(t)
	if _, err := relay.Migrate(context.Background(), e.conn, e.schema); err != nil {
		t.Fatalf("migrate %s: %v", e.schema, err)
	}
	return e
}

// startRelay starts `stagedrain run` on the test's schema and namespace.
func (e *relayEnv) startRelay(name string, args ...string) *proc {
	e.t.Helper()
	args = append([]string{"run", "--schema", e.schema, "--redis-namespace", e.ns}, args...)
	return startProc(e.t, name, childEnv(), args...)
}

// stage INSERTs n jobs named name with plain SQL in one transaction, and
// returns their jids.
func (e *relayEnv) stage(name string, n int) []string {
	e.t.Helper()
	rows, err := e.conn.Query(context.Background(),
		"INSERT INTO "+pgx.Identifier{e.schema, "staged_jobs"}.Sanitize()+
			" (job_name, job_args) SELECT $1, jsonb_build_array(g) FROM generate_series(1, $2) g RETURNING jid",
		name, n)
	if err != nil {
		e.t.Fatalf("stage %d jobs: %v", n, err)
	}
	jids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil || len(jids) != n {
		e.t.Fatalf("stage %d jobs: got jids %v, %v", n, jids, err)
	}
	return jids
}

func (e *relayEnv) queueKey() string { return e.ns + ":queue:default" }

// waitDelivered waits until queue:default holds n jobs and staged_jobs is
// empty.
func (e *relayEnv) waitDelivered(n int64) {
	e.t.Helper()
	relaytest.WaitFor(e.t, 15*time.Second, fmt.Sprintf("%d jobs in %s and none staged", n, e.queueKey()), func() (bool, string) {
		got, err := e.rdb.LLen(context.Background(), e.queueKey()).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return false, err.Error()
		}
		staged := stagedCount(e.t, e.conn, e.schema)
		return got == n && staged == 0, fmt.Sprintf("%d jobs in Redis, %d rows staged", got, staged)
	})
}

// queue returns the decoded payloads of queue:default.
func (e *relayEnv) queue() []map[string]any {
	e.t.Helper()
	raw, err := e.rdb.LRange(context.Background(), e.queueKey(), 0, -1).Result()
	if err != nil {
		e.t.Fatalf("LRANGE %s: %v", e.queueKey(), err)
	}
	jobs := make([]map[string]any, len(raw))
	for i, s := range raw {
		if err := json.Unmarshal([]byte(s), &jobs[i]); err != nil {
			e.t.Fatalf("payload is not JSON: %v: %s", err, s)
		}
	}
	return jobs
}

// checkAllJSON checks that every line p wrote to stdout is a JSON object
// with a level, a time, a logger and a message, and no key twice.
func checkAllJSON(t *testing.T, p *proc) {
	t.Helper()
	for _, l := range p.stdout.snapshot() {
		if l.fields == nil || l.str("level") == "" || l.str("logger") == "" || l.str("msg") == "" {
			t.Errorf("%s: stdout line is not a JSON log line: %s", p.name, l.raw)
			continue
		}
		if key := repeatedKey(l.raw); key != "" {
			t.Errorf("%s: log line has the key %q twice: %s", p.name, key, l.raw)
		}
		if _, err := l.time(); err != nil {
			t.Errorf("%s: log line time: %v: %s", p.name, err, l.raw)
		}
		if pid, _ := l.fields["pid"].(float64); l.str("host") == "" || int(pid) != p.cmd.Process.Pid {
			t.Errorf("%s: log line does not name host and pid %d: %s", p.name, p.cmd.Process.Pid, l.raw)
		}
	}
}

// repeatedKey returns a key that the JSON object raw holds twice at its
// top level ("" if none, or if raw is no object): encoding/json keeps the
// last silently, and some log pipelines refuse the line.
func repeatedKey(raw string) string {
	dec := json.NewDecoder(strings.NewReader(raw))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return ""
	}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return ""
		}
		key, _ := tok.(string)
		if seen[key] {
			return key
		}
		seen[key] = true
		var skip json.RawMessage
		if err := dec.Decode(&skip); err != nil {
			return ""
		}
	}
	return ""
}

// run refuses, with exit 1 and one line, a schema that was never migrated.
func TestRunNotMigrated(t *testing.T) {
	t.Parallel()
	schema := testSchema(t)
	_, ns := relaytest.Redis(t)
	p := startProc(t, "relay", childEnv(), "run", "--schema", schema, "--redis-namespace", ns)
	if code := p.wait(15 * time.Second); code != 1 {
		t.Fatalf("exit code %d, want 1; output:\n%s", code, p.output())
	}
	stderr := p.stderr.snapshot()
	if len(stderr) != 1 || !strings.Contains(stderr[0].raw, "stagedrain migrate") || !strings.Contains(stderr[0].raw, schema) {
		t.Fatalf("stderr = %q, want one line naming schema %s and 'stagedrain migrate'", p.output(), schema)
	}
	if p.count(rootLogger, "became leader") != 0 {
		t.Errorf("the relay became leader of a schema without staged_jobs")
	}
}

// run with --queues beside a relay whose list overlaps its own is refused,
// exit 1 and one line naming the queue; one with a disjoint list leads.
func TestRunQueuesConflict(t *testing.T) {
	t.Parallel()
	schema := testSchema(t)
	_, ns := relaytest.Redis(t)
	if r := runCLI("migrate", "--database-url", relaytest.DatabaseURL(), "--schema", schema); r.code != 0 {
		t.Fatalf("migrate: exit %d: %s", r.code, r.stderr)
	}
	args := []string{"run", "--schema", schema, "--redis-namespace", ns}
	ab := startProc(t, "ab", childEnv(), append(args, "--queues", "a,b")...)
	ab.waitLog(rootLogger, "became leader", 15*time.Second)
	bc := startProc(t, "bc", childEnv(), append(args, "--queues", "b,c")...)
	if code := bc.wait(15 * time.Second); code != 1 {
		t.Fatalf("exit code %d, want 1; output:\n%s", code, bc.output())
	}
	stderr := bc.stderr.snapshot()
	if len(stderr) != 1 || !strings.Contains(stderr[0].raw, `queue conflict in schema "`+schema+`"`) || !strings.Contains(stderr[0].raw, `queue "b"`) {
		t.Fatalf("stderr = %q, want one line naming the conflict and queue b", bc.output())
	}
	d := startProc(t, "d", childEnv(), append(args, "--queues", "d")...)
	d.waitLog(rootLogger, "became leader", 15*time.Second)
}

// run refuses, with exit 1 and one line, a schema whose recorded version is
// not the one it needs: the seed article's table migrate never upgraded,
// and a schema a newer stagedrain migrated.
func TestRunChecksSchemaVersion(t *testing.T) {
	t.Parallel()
	for _, tt := range []struct {
		name    string
		prepare func(t *testing.T, conn *pgx.Conn, schema string)
		want    func(latest int) []string
	}{
		{"seed table", func(t *testing.T, conn *pgx.Conn, schema string) {
			quoted := pgx.Identifier{schema}.Sanitize()
			for _, q := range []string{
				`CREATE SCHEMA ` + quoted,
				`CREATE TABLE ` + quoted + `.staged_jobs (id BIGSERIAL PRIMARY KEY, job_name TEXT NOT NULL, job_args JSONB NOT NULL)`,
				`INSERT INTO ` + quoted + `.staged_jobs (job_name, job_args) VALUES ('OldJob', '[1]')`,
			} {
				if _, err := conn.Exec(context.Background(), q); err != nil {
					t.Fatal(err)
				}
			}
		}, func(int) []string { return []string{"not migrated", "run 'stagedrain migrate' first"} }},
		{"newer version", func(t *testing.T, conn *pgx.Conn, schema string) {
			res, err := relay.Migrate(context.Background(), conn, schema)
			if err != nil {
				t.Fatal(err)
			}
			_, err = conn.Exec(context.Background(), `INSERT INTO `+pgx.Identifier{schema, "stagedrain_migrations"}.Sanitize()+
				` (version, name) VALUES ($1, 'from_a_newer_stagedrain.sql')`, res.Current+1)
			if err != nil {
				t.Fatal(err)
			}
		}, func(latest int) []string {
			return []string{fmt.Sprintf("schema version %d is newer than this stagedrain knows (%d): upgrade stagedrain", latest+1, latest)}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			schema := testSchema(t)
			conn := testConn(t)
			tt.prepare(t, conn, schema)
			_, ns := relaytest.Redis(t)
			p := startProc(t, "relay", childEnv(), "run", "--schema", schema, "--redis-namespace", ns)
			if code := p.wait(15 * time.Second); code != 1 {
				t.Fatalf("exit code %d, want 1; output:\n%s", code, p.output())
			}
			want := append(tt.want(latestVersion(t)), strconv.Quote(schema))
			stderr := p.stderr.snapshot()
			if len(stderr) != 1 {
				t.Fatalf("stderr = %q, want one line", p.output())
			}
			for _, w := range want {
				if !strings.Contains(stderr[0].raw, w) {
					t.Errorf("stderr = %q, want it to contain %q", stderr[0].raw, w)
				}
			}
			if p.count(rootLogger, "became leader") != 0 {
				t.Errorf("the relay became leader of a schema at the wrong version")
			}
		})
	}
}

// A relay delivers a job INSERTed with plain SQL, and on SIGTERM releases
// leadership and exits 0.
func TestRunDeliversAndStopsOnSIGTERM(t *testing.T) {
	t.Parallel()
	e := newRelayEnv(t)
	p := e.startRelay("relay", "--log-level", "debug")
	p.waitLog(rootLogger, "became leader", 15*time.Second)
	p.waitLog(listenLogger, "listening", 15*time.Second)

	var jid string
	err := e.conn.QueryRow(context.Background(),
		"INSERT INTO "+pgx.Identifier{e.schema, "staged_jobs"}.Sanitize()+
			" (job_name, job_args) VALUES ('WelcomeEmailJob', '[42]') RETURNING jid").Scan(&jid)
	if err != nil {
		t.Fatalf("stage: %v", err)
	}
	e.waitDelivered(1)
	job := e.queue()[0]
	if job["class"] != "WelcomeEmailJob" || job["queue"] != "default" || job["jid"] != jid {
		t.Errorf("payload = %v, want class WelcomeEmailJob, queue default, jid %s", job, jid)
	}
	if args, _ := job["args"].([]any); len(args) != 1 || args[0] != float64(42) {
		t.Errorf("payload args = %#v, want [42]", job["args"])
	}
	if s, _ := job["jid"].(string); !jidRE.MatchString(s) {
		t.Errorf("payload jid = %#v, want 24 lowercase hex characters", job["jid"])
	}
	if _, ok := job["enqueued_at"].(float64); !ok {
		t.Errorf("payload enqueued_at = %#v, want float epoch seconds", job["enqueued_at"])
	}
	drained := p.waitLog(drainLogger, "batch drained", 5*time.Second)
	if drained.str("level") != "debug" || drained.fields["count"] != float64(1) {
		t.Errorf("batch drained line = %s, want level debug and count 1", drained.raw)
	}

	p.signal(syscall.SIGTERM)
	if code := p.wait(15 * time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0; output:\n%s", code, p.output())
	}
	released := p.waitLog(rootLogger, "released leadership", 0)
	stopped := p.waitLog(rootLogger, "stopped", 0)
	if released.index > stopped.index {
		t.Errorf("\"stopped\" logged before \"released leadership\"; output:\n%s", p.output())
	}
	if s := p.stderr.snapshot(); len(s) != 0 {
		t.Errorf("stderr = %q, want nothing after a clean stop", p.output())
	}
	checkAllJSON(t, p)
}

// run --migrate migrates a fresh schema, then drains it.
func TestRunMigrateFlag(t *testing.T) {
	t.Parallel()
	schema := testSchema(t)
	rdb, ns := relaytest.Redis(t)
	conn := testConn(t)
	p := startProc(t, "relay", childEnv(), "run", "--migrate", "--schema", schema, "--redis-namespace", ns)
	migrated := p.waitLog(rootLogger, "migrated", 15*time.Second)
	if migrated.str("schema") != schema {
		t.Errorf("migrated line = %s, want schema %s", migrated.raw, schema)
	}
	p.waitLog(rootLogger, "became leader", 15*time.Second)
	if !tableExists(t, conn, schema, "staged_jobs") {
		t.Fatalf("run --migrate did not create %s.staged_jobs", schema)
	}
	jid, err := relay.NewStager(schema).Stage(context.Background(), conn, relay.Job{Name: "MigratedJob"})
	if err != nil {
		t.Fatal(err)
	}
	relaytest.WaitFor(t, 15*time.Second, "the job in queue:default", func() (bool, string) {
		got, err := rdb.LRange(context.Background(), ns+":queue:default", 0, -1).Result()
		return len(got) == 1 && strings.Contains(got[0], jid), fmt.Sprint(got, err)
	})
	p.signal(syscall.SIGTERM)
	if code := p.wait(15 * time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0", code)
	}
}

// While PostgreSQL cannot be reached, run logs and retries; neither its
// logs nor its exit show the password of the URL.
func TestRunNeverLogsPassword(t *testing.T) {
	t.Parallel()
	_, ns := relaytest.Redis(t)
	const password = "s3cretpw"
	// Nothing listens on port 1: every connection is refused.
	env := append(childEnv(), "DATABASE_URL=postgres://u:"+password+"@127.0.0.1:1/x")
	p := startProc(t, "relay", env, "run", "--redis-namespace", ns, "--max-backoff", "100ms")
	starting := p.waitLog(rootLogger, "starting", 15*time.Second)
	if got := starting.str("database"); got != "u@127.0.0.1:1/x" {
		t.Errorf("starting line names database %q, want u@127.0.0.1:1/x", got)
	}
	// Two failures: the error is logged, and so is a retry of it.
	if _, err := p.stdout.wait(15*time.Second, func(l logLine) bool {
		return l.is(rootLogger, "database session failed, retrying") && l.fields["attempt"] == float64(2)
	}); err != nil {
		t.Fatalf("second \"database session failed, retrying\": %v; output:\n%s", err, p.output())
	}
	p.signal(syscall.SIGTERM)
	if code := p.wait(15 * time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0", code)
	}
	if out := p.output(); strings.Contains(out, password) {
		t.Fatalf("the password shows in the output:\n%s", out)
	}
}

// A Redis that refuses the relay's credentials or DB: run exits 1 at start
// with one line naming the Redis target (never the password), before it
// leads, and the staged job stays staged.
func TestRunRedisRefused(t *testing.T) {
	t.Parallel()
	const password = "s3cret-redis-pw"
	port := relaytest.StartRedis(t, "--requirepass", password).Port
	private := fmt.Sprintf("127.0.0.1:%d", port)
	shared, err := redis.ParseURL(relaytest.RedisURL())
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name     string
		redisURL string
		target   string
		want     string
	}{
		{"DB out of range", fmt.Sprintf("redis://%s/99", shared.Addr), shared.Addr + "/99", "ERR DB index is out of range"},
		{"wrong password", fmt.Sprintf("redis://:wrong-%s@%s/0", password, private), private + "/0", "WRONGPASS"},
		{"no password", fmt.Sprintf("redis://%s/0", private), private + "/0", "NOAUTH"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newRelayEnv(t)
			e.stage("NeverLostJob", 1)
			p := startProc(t, "relay", childEnv("REDIS_URL="+tc.redisURL),
				"run", "--schema", e.schema, "--redis-namespace", e.ns, "--log-level", "debug")
			if code := p.wait(15 * time.Second); code != 1 {
				t.Fatalf("exit code %d, want 1; output:\n%s", code, p.output())
			}
			stderr := p.stderr.snapshot()
			prefix := "stagedrain: redis " + tc.target + ": "
			if len(stderr) != 1 || !strings.HasPrefix(stderr[0].raw, prefix) || !strings.Contains(stderr[0].raw, tc.want) {
				t.Fatalf("stderr = %q, want one line %q... containing %q", p.output(), prefix, tc.want)
			}
			starting := p.waitLog(rootLogger, "starting", 0)
			if got := starting.str("redis"); got != tc.target {
				t.Errorf("starting line names redis %q, want %s", got, tc.target)
			}
			if p.count(rootLogger, "became leader") != 0 {
				t.Errorf("the relay became leader before Redis accepted it")
			}
			if n := stagedCount(t, e.conn, e.schema); n != 1 {
				t.Errorf("%d rows staged, want 1", n)
			}
			if out := p.output(); strings.Contains(out, password) {
				t.Errorf("the password shows in the output:\n%s", out)
			}
			checkAllJSON(t, p)
		})
	}
}

// Two relays on one schema: one drains, the other waits; when the leader is
// SIGKILLed, the standby takes over (by design within 625ms: it tries
// every 500ms, jittered; the bound below leaves a busy 2-core machine room
// and still fails a standby that only tries after seconds) and delivers
// what follows, every job exactly once.
func TestFailover(t *testing.T) {
	t.Parallel()
	e := newRelayEnv(t)
	a := e.startRelay("relay A", "--log-level", "debug")
	a.waitLog(rootLogger, "became leader", 15*time.Second)
	a.waitLog(listenLogger, "listening", 15*time.Second)
	b := e.startRelay("relay B", "--log-level", "debug")
	b.waitLog(rootLogger, "standby: another relay is draining this schema", 15*time.Second)

	jids := e.stage("FailoverJob", 5)
	e.waitDelivered(5)
	a.waitLog(drainLogger, "batch drained", 5*time.Second)
	if n := b.count(drainLogger, "batch drained"); n != 0 {
		t.Fatalf("standby B logged %d \"batch drained\" lines, want 0; output:\n%s", n, b.output())
	}
	if n := b.count(rootLogger, "became leader"); n != 0 {
		t.Fatalf("B became leader while A led; output:\n%s", b.output())
	}

	killed := time.Now()
	if err := a.cmd.Process.Kill(); err != nil {
		t.Fatalf("SIGKILL A: %v", err)
	}
	if code := a.wait(10 * time.Second); code != -1 {
		t.Fatalf("A exited with code %d, want death by SIGKILL", code)
	}
	leader := b.waitLog(rootLogger, "became leader", 15*time.Second)
	at, err := leader.time()
	if err != nil {
		t.Fatalf("B's \"became leader\" line: %v", err)
	}
	failover := at.Sub(killed)
	t.Logf("failover: B became leader %s after A was killed (seen by the test after %s)", failover, leader.seen.Sub(killed))
	if failover <= 0 || failover > 4*time.Second {
		t.Errorf("B became leader %s after A was killed, want within 4s (625ms by design)", failover)
	}

	jids = append(jids, e.stage("FailoverJob", 5)...)
	e.waitDelivered(10)
	b.waitLog(drainLogger, "batch drained", 5*time.Second)
	seen := make(map[string]int)
	for _, j := range e.queue() {
		jid, _ := j["jid"].(string)
		seen[jid]++
		if j["class"] != "FailoverJob" {
			t.Errorf("payload %v, want class FailoverJob", j)
		}
	}
	for _, jid := range jids {
		if seen[jid] != 1 {
			t.Errorf("job %s is in the queue %d times, want once", jid, seen[jid])
		}
	}
	if len(seen) != len(jids) {
		t.Errorf("queue holds jids %v, want exactly %v", keys(seen), jids)
	}
	checkAllJSON(t, a)
	checkAllJSON(t, b)
}

func keys(m map[string]int) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	slices.Sort(ks)
	return ks
}

// A console log line of a connect failure is one line: pgx's error lists
// each address on a line of its own, which the console encoder would show
// as a literal "\n\t".
func TestConsoleLogErrorOnOneLine(t *testing.T) {
	t.Parallel()
	_, ns := relaytest.Redis(t)
	// Nothing listens on port 1 or 2: both addresses refuse.
	env := append(childEnv(), "DATABASE_URL=postgres://u@127.0.0.1:1,127.0.0.1:2/x")
	p := startProc(t, "relay", env, "run", "--redis-namespace", ns, "--log-format", "console", "--max-backoff", "100ms")
	ln, err := p.stdout.wait(15*time.Second, func(l logLine) bool {
		return strings.Contains(l.raw, "database session failed, retrying")
	})
	if err != nil {
		t.Fatalf("console line \"database session failed, retrying\": %v; output:\n%s", err, p.output())
	}
	if strings.Contains(ln.raw, `\n`) || strings.Contains(ln.raw, `\t`) {
		t.Errorf("console line %q shows an escaped newline or tab", ln.raw)
	}
	for _, addr := range []string{"127.0.0.1:1 (127.0.0.1): dial error", "; 127.0.0.1:2 (127.0.0.1): dial error"} {
		if strings.Count(ln.raw, addr) != 1 {
			t.Errorf("console line %q, want %q once", ln.raw, addr)
		}
	}
	p.signal(syscall.SIGTERM)
	if code := p.wait(15 * time.Second); code != 0 {
		t.Fatalf("exit code %d after SIGTERM, want 0", code)
	}
}
