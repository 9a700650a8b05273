package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/relaytest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func noEnv(string) string { return "" }

// The demo's lines, as the app and the worker log them.
var (
	committedRE  = regexp.MustCompile(`committed: user (\d+) \(\S+\) and its WelcomeJob jid=([0-9a-f]{24}), in one transaction$`)
	rolledBackRE = regexp.MustCompile(`rolled back on purpose: user (\d+) \(\S+\) and its WelcomeJob jid=([0-9a-f]{24}) are gone`)
	welcomedRE   = regexp.MustCompile(`welcome email for user (\d+) \(jid ([0-9a-f]{24})\)`)
	appTraceRE   = regexp.MustCompile(`(?m)trace ([0-9a-f]{32}): signed up user (\d+)$`)
	workTraceRE  = regexp.MustCompile(`trace ([0-9a-f]{32}): welcome email for user (\d+)`)
)

// traces returns the trace id logged for each user by lines matching re.
func traces(re *regexp.Regexp, out string) map[string]string {
	got := map[string]string{}
	for _, m := range re.FindAllStringSubmatch(out, -1) {
		got[m[2]] = m[1]
	}
	return got
}

// TestDemoCommittedUsersReachTheWorker runs the compose demo's story here:
// the demo app signs up users, rolling every 4th back; the relay drains
// staged_jobs into Redis; a real Sidekiq (Debian's ruby-sidekiq) runs
// cmd/demoworker/worker.rb. The worker must have run exactly the committed
// users' WelcomeJobs, each once, with the jid the app staged, and none of
// the rolled-back ones.
func TestDemoCommittedUsersReachTheWorker(t *testing.T) {
	ctx := t.Context()
	dbURL := relaytest.DatabaseURL()
	schema := relaytest.Schema(t, dbURL)
	conn := relaytest.Conn(t, dbURL)
	if _, err := relay.Migrate(ctx, conn, schema); err != nil {
		t.Fatalf("migrate %s: %v", schema, err)
	}
	// A private Redis, on a DB other than 0: the relay and Sidekiq must
	// both honour the URL's DB number to meet.
	redisURL := fmt.Sprintf("redis://127.0.0.1:%d/5", relaytest.StartRedis(t).Port)
	opts, err := redis.ParseURL(redisURL)
	if err != nil {
		t.Fatal(err)
	}
	opts.DisableIdentity = true
	rdb := redis.NewClient(opts)
	t.Cleanup(func() { _ = rdb.Close() }) // after the relay's cleanup below

	worker := startWorker(t, redisURL)

	r, err := relay.New(relay.Config{
		DatabaseURL: dbURL, Redis: rdb, Schema: schema,
		Logger: zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)),
	})
	if err != nil {
		t.Fatal(err)
	}
	relayCtx, stopRelay := context.WithCancel(context.Background())
	relayDone := make(chan error, 1)
	go func() { relayDone <- r.Run(relayCtx) }()
	t.Cleanup(func() {
		stopRelay()
		if err := <-relayDone; err != nil {
			t.Errorf("relay: %v", err)
		}
	})

	// 13 users, every 4th rolled back: 4, 8 and 12 roll back, and the last
	// one (13) commits, so its job is the last the worker runs.
	var out bytes.Buffer
	err = run(ctx, []string{"--database-url", dbURL, "--schema", schema,
		"--users", "13", "--rollback-every", "4", "--interval", "0"}, noEnv, &out)
	if err != nil {
		t.Fatalf("demoapp: %v\n%s", err, out.String())
	}
	committed, rolledBack := map[int64]string{}, map[int64]string{}
	var last int64
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		if m := committedRE.FindStringSubmatch(line); m != nil {
			id, _ := strconv.ParseInt(m[1], 10, 64)
			committed[id], last = m[2], id
		} else if m := rolledBackRE.FindStringSubmatch(line); m != nil {
			id, _ := strconv.ParseInt(m[1], 10, 64)
			rolledBack[id] = m[2]
		}
	}
	if len(committed) != 10 || len(rolledBack) != 3 {
		t.Fatalf("demoapp logged %d commits and %d rollbacks, want 10 and 3:\n%s", len(committed), len(rolledBack), out.String())
	}
	// What the app says it committed is what the database holds.
	var ids []int64
	rows, err := conn.Query(ctx, `SELECT id FROM "`+schema+`".demo_users ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id int64
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want := make([]int64, 0, len(committed))
	for id := range committed {
		want = append(want, id)
	}
	slices.Sort(want)
	if !slices.Equal(ids, want) {
		t.Fatalf("demo_users holds %v, the app logged commits of %v", ids, want)
	}

	// Sidekiq runs one job at a time (--concurrency 1), in the order the
	// relay pushed them (id order): once the last committed user's job
	// has run, every job staged before it has run too.
	relaytest.WaitFor(t, 60*time.Second, fmt.Sprintf("the worker to run user %d's WelcomeJob", last), func() (bool, string) {
		got := worker.welcomed()
		_, ok := got[last]
		return ok, fmt.Sprintf("welcomed %v; worker output:\n%s", got, worker.out.String())
	})
	got := worker.welcomed()
	for id, jid := range committed {
		if jids := got[id]; len(jids) != 1 || jids[0] != jid {
			t.Errorf("user %d committed with jid %s: the worker ran jids %v for it, want exactly that one", id, jid, jids)
		}
	}
	for id, jids := range got {
		if _, ok := committed[id]; !ok {
			t.Errorf("the worker ran a WelcomeJob for user %d (jids %v), which was never committed (rolled back: %v)", id, jids, rolledBack[id] != "")
		}
	}
	// One trace from the app's signup to the worker: the same trace id in
	// both logs, for every committed user.
	appTraces, workTraces := traces(appTraceRE, out.String()), traces(workTraceRE, worker.out.String())
	if len(appTraces) != len(committed) {
		t.Errorf("the app logged trace ids for %d users, want the %d committed", len(appTraces), len(committed))
	}
	for user, id := range appTraces {
		if workTraces[user] != id {
			t.Errorf("user %s: the app logged trace %s, the worker %q", user, id, workTraces[user])
		}
	}
	if n, err := rdb.LLen(ctx, "queue:default").Result(); err != nil || n != 0 {
		t.Errorf("queue:default holds %d jobs (%v), want none left", n, err)
	}
	var staged int
	if err := conn.QueryRow(ctx, `SELECT count(*) FROM "`+schema+`".staged_jobs`).Scan(&staged); err != nil || staged != 0 {
		t.Errorf("staged_jobs holds %d rows (%v), want none left", staged, err)
	}
	if t.Failed() {
		t.Logf("demoapp output:\n%s\nworker output:\n%s", out.String(), worker.out.String())
	}
}

// worker is a running `sidekiq -r cmd/demoworker/worker.rb`.
type worker struct {
	out *relaytest.Sidekiq
}

// welcomed returns the jids of the WelcomeJobs the worker logged, by user id.
func (w *worker) welcomed() map[int64][]string {
	got := map[int64][]string{}
	for _, m := range welcomedRE.FindAllStringSubmatch(w.out.String(), -1) {
		id, _ := strconv.ParseInt(m[1], 10, 64)
		got[id] = append(got[id], m[2])
	}
	return got
}

// startWorker starts Sidekiq on the demo's worker file, reading redisURL.
func startWorker(t *testing.T, redisURL string) *worker {
	t.Helper()
	return &worker{out: relaytest.StartSidekiq(t, "../demoworker/worker.rb", redisURL)}
}

// TestFlags: the environment sets every flag, the command line wins, and
// bad values are usage errors naming where they came from.
func TestFlags(t *testing.T) {
	t.Parallel()
	env := map[string]string{
		"DATABASE_URL": "postgres://db/app", "DEMOAPP_SCHEMA": "demo", "DEMOAPP_USERS": "7",
		"DEMOAPP_ROLLBACK_EVERY": "3", "DEMOAPP_INTERVAL": "250ms",
	}
	c, err := parse([]string{"--users", "9"}, func(k string) string { return env[k] }, nil)
	if err != nil {
		t.Fatal(err)
	}
	if want := (config{"postgres://db/app", "demo", 9, 3, 250 * time.Millisecond}); c != want {
		t.Errorf("parsed %+v, want %+v", c, want)
	}
	if len(envs) != len(env) {
		t.Errorf("demoapp reads %d variables, this test sets %d", len(envs), len(env))
	}

	for _, tc := range []struct {
		args []string
		env  map[string]string
		want string
	}{
		{nil, nil, "--database-url or $DATABASE_URL is required"},
		{[]string{"--database-url", "x", "--users", "-1"}, nil, "must not be negative"},
		{[]string{"--database-url", "x", "--bogus"}, nil, "flag provided but not defined: -bogus"},
		{[]string{"--database-url", "x", "extra"}, nil, `unexpected argument "extra"`},
		{nil, map[string]string{"DATABASE_URL": "x", "DEMOAPP_INTERVAL": "soon"}, "$DEMOAPP_INTERVAL: "},
	} {
		_, err := parse(tc.args, func(k string) string { return tc.env[k] }, nil)
		var ue usageError
		if !errors.As(err, &ue) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parse(%q, %v) = %v, want a usage error containing %q", tc.args, tc.env, err, tc.want)
		}
	}
}

// TestMissingTable: against a schema stagedrain never migrated, the demo
// says what to run, and creates nothing.
func TestMissingTable(t *testing.T) {
	t.Parallel()
	dbURL := relaytest.DatabaseURL()
	schema := relaytest.Schema(t, dbURL)
	err := run(t.Context(), []string{"--database-url", dbURL, "--schema", schema}, noEnv, new(bytes.Buffer))
	if err == nil || !strings.Contains(err.Error(), "run 'stagedrain migrate'") {
		t.Fatalf("run on an unmigrated schema: %v, want it to ask for stagedrain migrate", err)
	}
}
