package main

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
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

// defaultsEnv is a database and a Redis of a test's own, so that relays
// can run on them with every setting at its default: schema public, Redis
// DB 0 with no namespace, and no --metrics-addr. The database is a fresh
// one of the shared PostgreSQL server (advisory locks and NOTIFY channels
// are per database, so relays of other tests never meet these); the Redis
// is a private redis-server on a free port (no other test's keys).
type defaultsEnv struct {
	t           *testing.T
	databaseURL string
	redisURL    string
	conn        *pgx.Conn
	rdb         *redis.Client
}

func newDefaultsEnv(t *testing.T) *defaultsEnv {
	t.Helper()
	d := &defaultsEnv{t: t}
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "sdtest_" + hex.EncodeToString(b[:])
	admin := testConn(t)
	if _, err := admin.Exec(context.Background(), "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("create database %s: %v", name, err)
	}
	t.Cleanup(func() {
		// FORCE ends the sessions of relays still running.
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if _, err := admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("drop database %s: %v", name, err)
		}
	})
	u, err := url.Parse(relaytest.DatabaseURL())
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		t.Fatalf("the test database URL %q is not a postgres:// URL (%v)", relaytest.DatabaseURL(), err)
	}
	u.Path = "/" + name
	d.databaseURL = u.String()
	d.conn = relaytest.Conn(t, d.databaseURL) // closed before the DROP: cleanups run last first
	if _, err := relay.Migrate(context.Background(), d.conn, "public"); err != nil {
		t.Fatalf("migrate %s: %v", name, err)
	}

	port := relaytest.StartRedis(t).Port
	d.redisURL = fmt.Sprintf("redis://127.0.0.1:%d", port)
	d.rdb = redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", port), DisableIdentity: true})
	t.Cleanup(func() { _ = d.rdb.Close() })
	return d
}

// env is this process's environment without any stagedrain variable, plus
// DATABASE_URL and REDIS_URL: nothing else configures the relays.
func (d *defaultsEnv) env() []string {
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if !isStagedrainEnv(name) {
			env = append(env, kv)
		}
	}
	return append(env, "DATABASE_URL="+d.databaseURL, "REDIS_URL="+d.redisURL)
}

// start starts `stagedrain run` with args (none, or --queues).
func (d *defaultsEnv) start(name string, args ...string) *proc {
	d.t.Helper()
	return startProc(d.t, name, d.env(), append([]string{"run"}, args...)...)
}

// stage INSERTs a job for queue with plain SQL and returns its jid.
func (d *defaultsEnv) stage(queue string) string {
	d.t.Helper()
	var jid string
	err := d.conn.QueryRow(context.Background(),
		"INSERT INTO staged_jobs (job_name, job_args, queue) VALUES ('DefaultsJob', '[1]', $1) RETURNING jid", queue).Scan(&jid)
	if err != nil {
		d.t.Fatalf("stage a job for queue %s: %v", queue, err)
	}
	return jid
}

// waitDelivered waits until queue:<queue> (Sidekiq's key, no namespace)
// holds exactly the jids given, once each.
func (d *defaultsEnv) waitDelivered(queue string, jids ...string) {
	d.t.Helper()
	key := "queue:" + queue
	relaytest.WaitFor(d.t, 15*time.Second, fmt.Sprintf("jobs %v in %s", jids, key), func() (bool, string) {
		raw, err := d.rdb.LRange(context.Background(), key, 0, -1).Result()
		if err != nil {
			return false, err.Error()
		}
		var got []string
		for _, s := range raw {
			var job struct{ JID string }
			if err := json.Unmarshal([]byte(s), &job); err != nil {
				return false, fmt.Sprintf("payload is not JSON: %s", s)
			}
			got = append(got, job.JID)
		}
		slices.Sort(got)
		return slices.Equal(got, slices.Sorted(slices.Values(jids))), fmt.Sprintf("jids %v", got)
	})
}

// checkUp fails the test if any of ps has exited.
func checkUp(t *testing.T, ps ...*proc) {
	t.Helper()
	for _, p := range ps {
		select {
		case <-p.exited:
			t.Fatalf("%s exited (%v); output:\n%s", p.name, p.err, p.output())
		default:
		}
	}
}

// pair is a relay group of two on one host: the first to start leads, the
// second stands by.
type pair struct {
	queue           string // the queue its jobs go to
	leader, standby *proc
	delivered       []string // jids, in the order staged
}

// startPair starts two relays with args, the second once the first leads.
func (d *defaultsEnv) startPair(name, queue string, args ...string) *pair {
	d.t.Helper()
	p := &pair{queue: queue}
	p.leader = d.start(name+" 1", args...)
	p.leader.waitLog(rootLogger, "became leader", 15*time.Second)
	p.standby = d.start(name+" 2", args...)
	p.standby.waitLog(rootLogger, "standby: another relay is draining this schema", 15*time.Second)
	return p
}

// deliver stages a job and waits until it is in the pair's queue, with
// those before it.
func (d *defaultsEnv) deliver(p *pair) {
	d.t.Helper()
	p.delivered = append(p.delivered, d.stage(p.queue))
	d.waitDelivered(p.queue, p.delivered...)
}

// failover SIGKILLs the pair's leader and waits for its standby to lead.
func (d *defaultsEnv) failover(p *pair) {
	d.t.Helper()
	if n := p.standby.count(rootLogger, "became leader"); n != 0 {
		d.t.Fatalf("%s became leader while %s led; output:\n%s", p.standby.name, p.leader.name, p.standby.output())
	}
	p.leader.signal(syscall.SIGKILL)
	if code := p.leader.wait(10 * time.Second); code != -1 {
		d.t.Fatalf("%s exited with code %d, want death by SIGKILL", p.leader.name, code)
	}
	p.standby.waitLog(rootLogger, "became leader", 15*time.Second)
}

// Two relays on one host with nothing but DATABASE_URL and REDIS_URL (the
// metrics listener at its default): both stay up, one leads and the other
// stands by; a job INSERTed is delivered; when the leader is SIGKILLed the
// standby takes over and delivers the next.
func TestDefaultsTwoRelaysOnOneHost(t *testing.T) {
	t.Parallel()
	d := newDefaultsEnv(t)
	p := d.startPair("relay", "default")
	checkUp(t, p.leader, p.standby)
	d.deliver(p)
	checkUp(t, p.leader, p.standby)
	d.failover(p)
	d.deliver(p)
	checkUp(t, p.standby)
	checkAllJSON(t, p.standby)
}

// Two --queues groups on one host, each a leader and a standby, with
// nothing else but DATABASE_URL and REDIS_URL: all four stay up, each
// group drains its own queue, and each standby takes over from its
// SIGKILLed leader.
func TestDefaultsQueueGroupsOnOneHost(t *testing.T) {
	t.Parallel()
	d := newDefaultsEnv(t)
	a := d.startPair("group a", "a", "--queues", "a")
	b := d.startPair("group b", "b", "--queues", "b")
	checkUp(t, a.leader, a.standby, b.leader, b.standby)
	d.deliver(a)
	d.deliver(b)
	checkUp(t, a.leader, a.standby, b.leader, b.standby)
	d.checkGroupsStatus(map[string]*proc{"a": a.leader, "b": b.leader})

	d.failover(a)
	d.deliver(a)
	d.deliver(b) // b's leader is untouched
	checkUp(t, a.standby, b.leader, b.standby)
	d.checkGroupsStatus(map[string]*proc{"a": a.standby, "b": b.leader})
	if n := b.standby.count(rootLogger, "became leader"); n != 0 {
		t.Fatalf("%s became leader when group a's leader died; output:\n%s", b.standby.name, b.standby.output())
	}
	d.failover(b)
	d.deliver(b)
	checkUp(t, a.standby, b.standby)
}

// checkGroupsStatus checks that status shows each group of relays, by its
// queue, with the relay given as its leader, as text and as JSON (whose
// single leader is null: there are several groups), and that the README's
// health check passes on that JSON, and fails when a group has no leader
// or no group runs.
func (d *defaultsEnv) checkGroupsStatus(leaders map[string]*proc) {
	d.t.Helper()
	args := []string{"status", "--database-url", d.databaseURL}
	r := runCLI(args...)
	if r.code != 0 || r.stderr != "" {
		d.t.Fatalf("status: exit %d, stderr %q; want 0 and nothing", r.code, r.stderr)
	}
	for q, p := range leaders {
		re := `(?m)^leader +queues ` + regexp.QuoteMeta(q) + `: \S+ pid ` + strconv.Itoa(p.cmd.Process.Pid) +
			` \(backend \d+( from \S+)?, connected \S+\)$`
		if !regexp.MustCompile(re).MatchString(r.stdout) {
			d.t.Errorf("status does not show %s as the leader of queue %s (%s):\n%s", p.name, q, re, r.stdout)
		}
	}
	if n := strings.Count(r.stdout, "\nleader "); n != len(leaders) {
		d.t.Errorf("status shows %d leader lines, want %d:\n%s", n, len(leaders), r.stdout)
	}

	r = runCLI(append(args, "--json")...)
	if r.code != 0 || r.stderr != "" {
		d.t.Fatalf("status --json: exit %d, stderr %q; want 0 and nothing", r.code, r.stderr)
	}
	var st schemaStatus
	if err := json.Unmarshal([]byte(r.stdout), &st); err != nil {
		d.t.Fatalf("status --json printed %q: %v", r.stdout, err)
	}
	host, _ := os.Hostname()
	if st.Leader != nil || len(st.Groups) != len(leaders) {
		d.t.Errorf("status --json: leader %+v and %d groups, want null and %d:\n%s", st.Leader, len(st.Groups), len(leaders), r.stdout)
	}
	for _, g := range st.Groups {
		if len(g.Queues) != 1 || leaders[g.Queues[0]] == nil {
			d.t.Errorf("status --json: a group of queues %q, want one of a group per queue of %d", g.Queues, len(leaders))
			continue
		}
		p := leaders[g.Queues[0]]
		if l := g.Leader; l == nil || l.PID != p.cmd.Process.Pid || l.Host == "" || !strings.HasPrefix(host, l.Host) ||
			l.BackendPID == 0 || l.ConnectedAt.IsZero() {
			d.t.Errorf("status --json: group %q's leader %+v, want %s (pid %d, host %s)", g.Queues, g.Leader, p.name, p.cmd.Process.Pid, host)
		}
	}

	// The README's check, as a user runs it.
	check := readmeHealthCheck(d.t)
	jq := func(doc any) int {
		d.t.Helper()
		in, err := json.Marshal(doc)
		if err != nil {
			d.t.Fatal(err)
		}
		cmd := exec.Command("jq", "-e", check)
		cmd.Stdin = bytes.NewReader(in)
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		switch {
		case err == nil:
			return 0
		case errors.As(err, &exit):
			return exit.ExitCode()
		}
		d.t.Fatalf("jq (the README's health check needs it): %v: %s", err, out)
		return -1
	}
	var doc map[string]any
	if err := json.Unmarshal([]byte(r.stdout), &doc); err != nil {
		d.t.Fatal(err)
	}
	if code := jq(doc); code != 0 {
		d.t.Errorf("the README's health check %q exits %d on every group led, want 0:\n%s", check, code, r.stdout)
	}
	groups, _ := doc["groups"].([]any)
	if len(groups) == 0 {
		d.t.Fatalf("status --json lists no groups:\n%s", r.stdout)
	}
	groups[len(groups)-1].(map[string]any)["leader"] = nil
	if code := jq(doc); code != 1 {
		d.t.Errorf("the README's health check %q exits %d with a group without a leader, want 1", check, code)
	}
	doc["groups"] = []any{}
	if code := jq(doc); code != 1 {
		d.t.Errorf("the README's health check %q exits %d with no group running, want 1", check, code)
	}
}

// readmeHealthCheck is the jq filter of the README's health check from
// the database.
func readmeHealthCheck(t *testing.T) string {
	t.Helper()
	m := regexp.MustCompile(`(?m)^stagedrain status --json \| jq -e '([^']+)'$`).FindStringSubmatch(readRepoFile(t, "cmd/stagedrain/README.md"))
	if m == nil {
		t.Fatal("README.md has no line `stagedrain status --json | jq -e '...'`")
	}
	return m[1]
}

// run exits 1 with one line naming --metrics-addr and what to do when the
// address is taken (here by the test; on a host, by another relay or an
// exporter), given as a flag or in the environment (as the image does).
func TestMetricsAddrTaken(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	addr := l.Addr().String()
	const advice = ": address already in use (another relay or exporter on this host has it); " +
		"give each relay its own --metrics-addr, or leave it unset (off)"
	for _, tc := range []struct {
		name string
		env  []string
		args []string
		want string
	}{
		{"flag", childEnv(), []string{"run", "--metrics-addr", addr}, "stagedrain: run: --metrics-addr " + addr + advice},
		{"environment", childEnv("STAGEDRAIN_METRICS_ADDR=" + addr), []string{"run"},
			"stagedrain: run: --metrics-addr " + addr + " (from $STAGEDRAIN_METRICS_ADDR)" + advice},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startProc(t, "relay", tc.env, tc.args...)
			if code := p.wait(15 * time.Second); code != 1 {
				t.Fatalf("exit code %d, want 1; output:\n%s", code, p.output())
			}
			if stderr := p.stderr.snapshot(); len(stderr) != 1 || stderr[0].raw != tc.want {
				t.Fatalf("stderr:\n%s\nwant the one line %q", p.output(), tc.want)
			}
			if n := p.count(rootLogger, "starting"); n != 0 {
				t.Errorf("the relay started before it had its listener; output:\n%s", p.output())
			}
		})
	}
}

// The image turns the listener on, at the port it EXPOSEs, for its
// HEALTHCHECK (stagedrain health with no flag reads the same variable), as
// does the compose file; the binary alone has it off, and health then says
// which flag to set.
func TestMetricsOnInTheImageOffInTheBinary(t *testing.T) {
	t.Parallel()
	df := readRepoFile(t, "cmd/stagedrain/Dockerfile")
	m := regexp.MustCompile(`(?m)^ENV STAGEDRAIN_METRICS_ADDR=(\S+)$`).FindStringSubmatch(df)
	if m == nil {
		t.Fatal("the Dockerfile has no ENV STAGEDRAIN_METRICS_ADDR=<addr> line: the image would serve no /readyz to its HEALTHCHECK")
	}
	_, port, err := net.SplitHostPort(m[1])
	if metricsOff(m[1]) || err != nil {
		t.Fatalf("the Dockerfile sets STAGEDRAIN_METRICS_ADDR=%s, want a host:port (%v)", m[1], err)
	}
	if !regexp.MustCompile(`(?m)^EXPOSE ` + regexp.QuoteMeta(port) + `$`).MatchString(df) {
		t.Errorf("the Dockerfile listens on %s but does not EXPOSE %s", m[1], port)
	}
	if got := composeServices(t)["stagedrain"].value("environment", "STAGEDRAIN_METRICS_ADDR"); got != m[1] {
		t.Errorf("docker-compose.yml sets STAGEDRAIN_METRICS_ADDR %q, want the image's %q", got, m[1])
	}

	f, c := newRunFlags()
	if err := f.parse(nil, nil); err != nil {
		t.Fatal(err)
	}
	if !metricsOff(c.metricsAddr) {
		t.Errorf("run's --metrics-addr defaults to %q, want off", c.metricsAddr)
	}
	r := runCLI("health")
	checkUsageError(t, r, "health: --metrics-addr is off", "set --metrics-addr (or $STAGEDRAIN_METRICS_ADDR)")
}
