package relay_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/admin"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// jobsTo returns n jobs of queue q, each args [i] and pad (pad may be "").
func jobsTo(q string, n int, pad string) []relay.Job {
	jobs := make([]relay.Job, n)
	for i := range jobs {
		jobs[i] = relay.Job{Name: "TracedJob", Queue: q, Args: []any{i, pad}}
	}
	return jobs
}

// quietSecond returns how many batches the relay committed over one second:
// a paused relay must not spin. (A window of measurement, not a wait for
// anything.)
func quietSecond(t *testing.T, url string) float64 {
	t.Helper()
	before := scrapeMetrics(t, url).value("stagedrain_batches_total")
	<-time.After(time.Second)
	return scrapeMetrics(t, url).value("stagedrain_batches_total") - before
}

// With --max-queue-length, a queue that holds the limit gets no more jobs:
// its rows stay staged (one batch's overshoot at most) while another
// queue's flow, without a hot loop; once a consumer takes jobs from it, the
// relay resumes by itself and delivers each job exactly once.
func TestBackpressureMaxQueueLength(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	const limit, batch = 100, 30
	cfg := h.config()
	cfg.MaxQueueLength, cfg.BatchSize = limit, batch
	r := h.start(cfg)
	srv := httptest.NewServer(r.MetricsHandler())
	t.Cleanup(srv.Close)

	full := h.stageMany(jobsTo("full", 150, "")...)
	// 0, 30, 60, 90 are below the limit: four batches go, the fifth waits.
	h.waitLog("backpressure: pushes paused, jobs wait in PostgreSQL", 1)
	h.waitStaged(150 - 120)
	if n := h.rdb.LLen(ctx, h.key("queue:full")).Val(); n != 120 {
		t.Fatalf("queue:full holds %d jobs, want 120 (limit %d, overshoot below one batch of %d)", n, limit, batch)
	}
	paused := h.logs.FilterMessage("backpressure: pushes paused, jobs wait in PostgreSQL").All()[0]
	if d := paused.ContextMap()["detail"]; d != "BACKPRESSURE "+h.key("queue:full")+" holds 120 >= --max-queue-length 100" {
		t.Fatalf("pause detail %q", d)
	}
	// Another queue flows meanwhile.
	flow := h.stageMany(jobsTo("flow", 50, "")...)
	h.waitQueueLen("flow", 50, 10*time.Second)
	h.waitStaged(30)
	s := scrapeMetrics(t, srv.URL)
	if v := s.value("stagedrain_backpressure", "queue", "full", "reason", "queue_length"); v != 1 {
		t.Fatalf("stagedrain_backpressure{queue=full} = %v while paused, want 1", v)
	}
	if p := r.Status().Paused; !slices.Equal(p, []relay.Paused{{Queue: "full", Reason: "queue_length"}}) {
		t.Fatalf("Status().Paused = %v while paused, want full (queue_length)", p)
	}
	if err := r.CheckReady(ctx); err != nil {
		t.Fatalf("CheckReady while paused: %v, want ready", err)
	}
	if n := quietSecond(t, srv.URL); n > 8 {
		t.Fatalf("%v batches committed over a paused second, want a few (no hot loop)", n)
	}
	if n := h.rdb.LLen(ctx, h.key("queue:full")).Val(); n != 120 {
		t.Fatalf("queue:full holds %d jobs while paused, want 120", n)
	}
	if got := h.logs.FilterMessage("backpressure: pushes paused, jobs wait in PostgreSQL").Len(); got != 1 {
		t.Fatalf("%d pause lines, want 1", got)
	}

	// The consumer takes 100 jobs: 20 left, below the limit.
	var seen []string
	for range 100 {
		v, err := h.rdb.RPop(ctx, h.key("queue:full")).Result()
		if err != nil {
			t.Fatal(err)
		}
		seen = append(seen, decodeJob(t, v).jid())
	}
	h.waitLog("backpressure: pushes resumed", 1)
	h.waitQueueLen("full", 50, 10*time.Second)
	h.waitStaged(0)
	seen = append(seen, h.queueJIDs("full")...)
	slices.Sort(seen)
	slices.Sort(full)
	if !slices.Equal(seen, full) {
		t.Fatalf("queue full delivered %d jids (%d distinct), want each of the %d exactly once", len(seen), len(slices.Compact(slices.Clone(seen))), len(full))
	}
	if got := h.queueJIDs("flow"); len(got) != len(flow) {
		t.Fatalf("queue flow holds %d jobs, want %d", len(got), len(flow))
	}
	if v := scrapeMetrics(t, srv.URL).value("stagedrain_backpressure", "queue", "full", "reason", "queue_length"); v != 0 {
		t.Fatalf("stagedrain_backpressure{queue=full} = %v after resume, want 0", v)
	}
	if p := r.Status().Paused; p != nil {
		t.Fatalf("Status().Paused = %v after resume, want nil", p)
	}
	for _, m := range messages(h.logs) {
		if strings.Contains(m, "job refused by Redis") {
			t.Fatalf("a held job was logged one by one: %v", messages(h.logs))
		}
	}
}

// With --redis-max-memory-ratio, a Redis with maxmemory (noeviction) that
// no worker reads pauses the relay before Redis refuses a write: no OOM in
// the run, the jobs wait staged, and the drain loop does not spin. A real
// Sidekiq started later drains the queue; the relay resumes by itself and
// each job runs exactly once.
func TestBackpressureRedisMemorySidekiq(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	srv := testenv.StartRedis(t, "--maxmemory-policy", "noeviction")
	opts, _ := redis.ParseURL(srv.URL())
	rdb := redis.NewClient(testenv.RedisOptions(opts))
	t.Cleanup(func() { _ = rdb.Close() })
	info := func(section, field string) int64 {
		t.Helper()
		v, err := rdb.Info(ctx, section).Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(v, "\n") {
			if rest, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
				// used_memory:123, cmdstat_evalsha:calls=4,..., errorstat_OOM:count=2
				if _, after, ok := strings.Cut(rest, "="); ok {
					rest, _, _ = strings.Cut(after, ",")
				}
				n, err := strconv.ParseInt(rest, 10, 64)
				if err != nil {
					t.Fatalf("INFO %s: %s: %v", section, line, err)
				}
				return n
			}
		}
		return 0
	}
	// The relay reads INFO at most every 500ms: 16MB between the pause and
	// maxmemory is far more than the test stages in that time.
	used0 := info("memory", "used_memory")
	maxmemory := used0 + 18<<20
	if err := rdb.ConfigSet(ctx, "maxmemory", fmt.Sprint(maxmemory)).Err(); err != nil {
		t.Fatal(err)
	}
	cfg := h.config()
	cfg.Redis, cfg.RedisNamespace, cfg.BatchSize = rdb, "", 20
	cfg.RedisMaxMemoryRatio = float64(used0+2<<20) / float64(maxmemory)
	r := h.start(cfg)
	msrv := httptest.NewServer(r.MetricsHandler())
	t.Cleanup(msrv.Close)

	const pauseLine = "backpressure: pushes paused, jobs wait in PostgreSQL"
	pad := strings.Repeat("x", 5000)
	var jids []string
	for len(jids) < 4000 && h.logs.FilterMessage(pauseLine).Len() == 0 {
		jids = append(jids, h.stageMany(jobsTo("default", 20, pad)...)...)
		testenv.WaitFor(t, 10*time.Second, "the chunk pushed, or a pause", func() (bool, string) {
			return h.staged() == 0 || h.logs.FilterMessage(pauseLine).Len() > 0, fmt.Sprintf("%d staged", h.staged())
		})
	}
	t.Logf("paused after %d jobs at used_memory %d of maxmemory %d", len(jids), info("memory", "used_memory"), maxmemory)
	if h.logs.FilterMessage(pauseLine).Len() == 0 {
		t.Fatalf("no pause after %d jobs; used_memory %d of %d", len(jids), info("memory", "used_memory"), maxmemory)
	}
	// More jobs while paused: they wait in PostgreSQL.
	jids = append(jids, h.stageMany(jobsTo("default", 60, pad)...)...)
	testenv.WaitFor(t, 10*time.Second, "jobs held staged", func() (bool, string) {
		return h.staged() >= 60, fmt.Sprintf("%d staged", h.staged())
	})
	if v := scrapeMetrics(t, msrv.URL).value("stagedrain_backpressure", "queue", "*", "reason", "memory"); v != 1 {
		t.Fatalf("stagedrain_backpressure{reason=memory} = %v while paused, want 1", v)
	}
	if p := r.Status().Paused; !slices.Equal(p, []relay.Paused{{Queue: "*", Reason: "memory"}}) {
		t.Fatalf("Status().Paused = %v while paused, want * (memory)", p)
	}
	// Published for stagedrain status too (below maxmemory, Redis takes it).
	published := func() []relay.Paused {
		p, err := admin.ReadPaused(ctx, rdb, "", h.conn.Config().Database, h.schema)
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	testenv.WaitFor(t, 10*time.Second, "ReadPaused to show * (memory)", func() (bool, string) {
		p := published()
		return slices.Equal(p, []relay.Paused{{Queue: "*", Reason: "memory"}}), fmt.Sprint(p)
	})
	if err := r.CheckReady(ctx); err != nil {
		t.Fatalf("CheckReady while paused: %v, want ready", err)
	}
	staged, queued := h.staged(), rdb.LLen(ctx, "queue:default").Val()
	scripts := info("commandstats", "cmdstat_evalsha")
	if n := quietSecond(t, msrv.URL); n > 3 {
		t.Fatalf("%v batches committed over a paused second, want at most a few (no hot loop)", n)
	}
	if n := info("commandstats", "cmdstat_evalsha") - scripts; n > 0 {
		t.Fatalf("%d push scripts ran over a paused second, want none", n)
	}
	if s, q := h.staged(), rdb.LLen(ctx, "queue:default").Val(); s != staged || q != queued {
		t.Fatalf("while paused: %d staged, %d queued; before %d, %d", s, q, staged, queued)
	}

	out := startTraceWorker(t, srv.URL())
	h.waitLog("backpressure: pushes resumed", 1)
	testenv.WaitFor(t, 10*time.Second, "ReadPaused to show nothing", func() (bool, string) {
		p := published()
		return p == nil, fmt.Sprint(p)
	})
	testenv.WaitFor(t, 60*time.Second, "Sidekiq to run every job", func() (bool, string) {
		n := strings.Count(out.String(), "traced ")
		return n >= len(jids) && h.staged() == 0, fmt.Sprintf("%d of %d ran, %d staged", n, len(jids), h.staged())
	})
	ran := map[string]int{}
	for _, line := range strings.Split(out.String(), "\n") {
		if _, js, ok := strings.Cut(line, "traced "); ok {
			var j tracedJob
			if err := json.Unmarshal([]byte(js), &j); err != nil {
				t.Fatalf("worker line %q: %v", line, err)
			}
			ran[j.JID]++
		}
	}
	for _, jid := range jids {
		if ran[jid] != 1 {
			t.Fatalf("job %s ran %d times, want once (%d jobs, %d distinct ran)", jid, ran[jid], len(jids), len(ran))
		}
	}
	if len(ran) != len(jids) {
		t.Fatalf("%d distinct jobs ran, want %d", len(ran), len(jids))
	}
	if n := info("errorstats", "errorstat_OOM"); n != 0 {
		t.Fatalf("Redis answered OOM %d times", n)
	}
	for _, e := range h.logs.All() {
		if line := fmt.Sprint(e.Message, e.ContextMap()); strings.Contains(line, "OOM") {
			t.Fatalf("an OOM in the relay's logs: %s", line)
		}
	}
}

// A relay that loses leadership while it pauses a queue pauses nothing
// any more: its stagedrain_backpressure goes to 0 and Status().Paused to
// nil, and the new leader finds the pause anew at its first push.
func TestBackpressureEndsWithLeadership(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	cfg := h.config()
	cfg.MaxQueueLength, cfg.BatchSize, cfg.LeaderInterval = 1, 1, 100*time.Millisecond
	a := h.start(cfg)
	srvA := httptest.NewServer(a.MetricsHandler())
	t.Cleanup(srvA.Close)
	h.stageMany(jobsTo("full", 2, "")...)
	testenv.WaitFor(t, 10*time.Second, "the leader pauses queue full", func() (bool, string) {
		p := a.Status().Paused
		return len(p) == 1, fmt.Sprintf("paused %v", p)
	})
	b := h.start(cfg)
	testenv.WaitFor(t, 10*time.Second, "a standby", func() (bool, string) {
		return b.Status().Role == relay.RoleStandby, string(b.Status().Role)
	})
	// End the leader's lock session. The old leader reconnects and campaigns
	// again after its backoff, and on a busy machine it can take the lock
	// back before the standby's next try: while a leads, end its session
	// again (each of its lock sessions once), until b leads.
	ended := map[int]bool{}
	endLeader := func() string {
		st, err := admin.ReadStatus(ctx, h.conn, admin.StatusParams{Schema: h.schema})
		if err != nil || st.Leader == nil {
			return fmt.Sprintf("ReadStatus: leader %+v, %v", st.Leader, err)
		}
		pid := st.Leader.BackendPID
		if ended[pid] {
			return fmt.Sprintf("backend %d ended", pid)
		}
		var ok bool
		if err := h.conn.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pid).Scan(&ok); err != nil || !ok {
			t.Fatalf("pg_terminate_backend(%d) = %v, %v", pid, ok, err)
		}
		ended[pid] = true
		return fmt.Sprintf("ended backend %d", pid)
	}
	endLeader()
	testenv.WaitFor(t, 20*time.Second, "the standby leads and pauses queue full", func() (bool, string) {
		if b.Status().Role == relay.RoleLeader && len(b.Status().Paused) == 1 {
			return true, ""
		}
		seen := ""
		if a.Status().Role == relay.RoleLeader && b.Status().Role != relay.RoleLeader {
			seen = "; a leads again: " + endLeader()
		}
		return false, fmt.Sprintf("b: %s, paused %v; a: %s%s", b.Status().Role, b.Status().Paused, a.Status().Role, seen)
	})
	// The old leader learns it lost its lock connection by itself (its
	// next check, or the connection's error): wait for that, not a moment.
	testenv.WaitFor(t, 10*time.Second, "the old leader steps down and pauses nothing", func() (bool, string) {
		st := a.Status()
		return st.Role != relay.RoleLeader && st.Paused == nil, fmt.Sprintf("role %s, Status().Paused %v", st.Role, st.Paused)
	})
	if v := scrapeMetrics(t, srvA.URL).value("stagedrain_backpressure", "queue", "full", "reason", "queue_length"); v != 0 {
		t.Fatalf("the old leader's stagedrain_backpressure{queue=full} = %v, want 0", v)
	}
}

// A long backlog of a paused queue does not hold up the queues behind it:
// the claims leave the paused queue's rows out (but for one look every
// 500ms), so the other queue's jobs, staged after 3,000 paused ones, are
// delivered at once rather than after the relay has claimed and put back
// every paused row ahead of them, 40 every 500ms.
func TestBackpressureLongPausedBacklogLetsOthersFlow(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	const limit, batch = 10, 10
	cfg := h.config()
	cfg.MaxQueueLength, cfg.BatchSize = limit, batch
	h.start(cfg)
	h.stageMany(jobsTo("full", 3000, "")...)
	h.waitLog("backpressure: pushes paused, jobs wait in PostgreSQL", 1)
	flow := h.stageMany(jobsTo("flow", 5, "")...)
	h.waitQueueLen("flow", 5, 5*time.Second)
	if got := h.queueJIDs("flow"); len(got) != len(flow) {
		t.Fatalf("queue flow holds %v, want %v", got, flow)
	}
	if n := h.rdb.LLen(ctx, h.key("queue:full")).Val(); n > limit+batch {
		t.Fatalf("queue:full holds %d jobs, want at most %d", n, limit+batch)
	}
	// And the paused queue resumes once it has room.
	if err := h.rdb.Del(ctx, h.key("queue:full")).Err(); err != nil {
		t.Fatal(err)
	}
	h.waitLog("backpressure: pushes resumed", 1)
}

// With each source, a queue paused for its length does not hold up the
// queues behind it (issue 22): 100 jobs of queue a, then one of b, all
// staged before the relay starts (so no commit wakes it), batches of 10 and
// --max-queue-length 1. b arrives while a is paused, and so does a second
// b staged meanwhile; once a consumer takes a's jobs the relay resumes, and
// every job is delivered exactly once.
func TestBackpressurePausedQueueLetsOthersFlowEachSource(t *testing.T) {
	t.Parallel()
	for _, src := range []relay.Source{relay.SourceStagedJobs, relay.SourceSidekiqStagedPush} {
		t.Run(string(src), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			var h *harness
			var stage func(q string, from, n int) []string // jids
			var staged func() int
			if src == relay.SourceStagedJobs {
				h = newHarness(t)
				stage = func(q string, _, n int) []string { return h.stageMany(jobsTo(q, n, "")...) }
				staged = h.staged
			} else {
				h = newStagedPushHarness(t)
				if _, err := relay.Migrate(ctx, h.conn, h.schema, relay.WithSource(relay.SourceSidekiqStagedPush)); err != nil {
					t.Fatal(err)
				}
				stage = func(q string, from, n int) []string {
					var payloads, jids []string
					for i := from; i < from+n; i++ {
						jid := fmt.Sprintf("%024x", i)
						payloads = append(payloads, fmt.Sprintf(`{"class":"W","args":[%d],"queue":%q,"jid":%q}`, i, q, jid))
						jids = append(jids, jid)
					}
					h.pushStaged(payloads...)
					return jids
				}
				staged = func() int { return len(h.gemRows()) }
			}
			cfg := h.config()
			cfg.Source, cfg.BatchSize, cfg.MaxQueueLength = src, 10, 1
			a := stage("a", 0, 100)
			b := stage("b", 100, 1)
			r := h.start(cfg)

			pausedA := func() bool {
				return slices.Contains(r.Status().Paused, relay.Paused{Queue: "a", Reason: "queue_length"})
			}
			lenA := func() int64 { return h.rdb.LLen(ctx, h.key("queue:a")).Val() }
			testenv.WaitFor(t, 10*time.Second, "queue b's job while a is paused", func() (bool, string) {
				return h.rdb.LLen(ctx, h.key("queue:b")).Val() == 1,
					fmt.Sprintf("queue:a %d, queue:b %d, %d staged, paused %v", lenA(), h.rdb.LLen(ctx, h.key("queue:b")).Val(), staged(), r.Status().Paused)
			})
			if !pausedA() || lenA() != 10 {
				t.Fatalf("queue:a holds %d, paused %v; want 10 (one batch), a paused", lenA(), r.Status().Paused)
			}
			// The claims left a out once a batch found it full: b came after
			// the rows of that batch and of the one claimed meanwhile were
			// put back, not after every row of a ahead of it (90).
			putBack := 0
			for _, e := range h.logs.FilterMessage("batch drained").All() {
				f := e.ContextMap()
				if f["count"] == int64(1) && fmt.Sprint(f["queues"]) == "[b]" {
					break
				}
				putBack += int(f["left_staged"].(int64))
			}
			if putBack > 30 {
				t.Fatalf("%d rows of a put back before b was pushed, want at most 30 (the batch that found a full, and the one claimed meanwhile)", putBack)
			}
			// A b staged while a is paused flows too, once b has room.
			if v, err := h.rdb.RPop(ctx, h.key("queue:b")).Result(); err != nil || decodeJob(t, v).jid() != b[0] {
				t.Fatalf("queue:b's job: %v, %v; want jid %s", v, err, b[0])
			}
			b = append(b, stage("b", 101, 1)...)
			testenv.WaitFor(t, 10*time.Second, "the second b while a is paused", func() (bool, string) {
				return h.rdb.LLen(ctx, h.key("queue:b")).Val() == 1, fmt.Sprintf("queue:b %d", h.rdb.LLen(ctx, h.key("queue:b")).Val())
			})
			if !pausedA() || lenA() != 10 {
				t.Fatalf("queue:a holds %d, paused %v; want 10, a paused", lenA(), r.Status().Paused)
			}

			// A consumer takes a's jobs: the relay resumes, a batch at a time.
			var seen []string
			testenv.WaitFor(t, 60*time.Second, "the consumer to take every job of a", func() (bool, string) {
				for {
					v, err := h.rdb.RPop(ctx, h.key("queue:a")).Result()
					if err != nil {
						break
					}
					seen = append(seen, decodeJob(t, v).jid())
				}
				return len(seen) >= len(a) && staged() == 0, fmt.Sprintf("%d of %d taken, %d staged", len(seen), len(a), staged())
			})
			slices.Sort(seen)
			if want := slices.Sorted(slices.Values(a)); !slices.Equal(seen, want) {
				t.Fatalf("queue a delivered %d jobs (%d distinct), want each of %d once", len(seen), len(slices.Compact(slices.Clone(seen))), len(want))
			}
			if got := h.queueJIDs("b"); !slices.Equal(got, b[1:]) {
				t.Fatalf("queue b holds %v, want %v", got, b[1:])
			}
			if n := lenA(); n != 0 {
				t.Fatalf("queue:a holds %d more jobs after all were taken", n)
			}
		})
	}
}

// With --redis-wait-replicas, a batch that holds a row an earlier push
// delivered (its WAIT failed, so its delete did not commit) runs the push
// script even while Redis is over --redis-max-memory-ratio, to WAIT for
// that push: and it pushes nothing else (issue 22, section 5). Here the
// replica is frozen while B is pushed, Redis goes over the ratio, and C is
// staged: the retries of the batch of B and C push no C. Once the replica
// runs again B's row is deleted and C stays staged until Redis is below
// the ratio; each job is pushed once.
func TestBackpressureMemoryHoldsWithWaitReplicas(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	primary := testenv.StartRedis(t, "--maxmemory-policy", "noeviction")
	replica := testenv.StartRedis(t, "--replicaof", "127.0.0.1", fmt.Sprint(primary.Port))
	h := newHarness(t)
	rdb := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", primary.Port), DisableIdentity: true})
	t.Cleanup(func() { _ = rdb.Close() })
	h.rdb = rdb
	testenv.WaitFor(t, 15*time.Second, "the replica to be in sync", func() (bool, string) {
		n, err := rdb.Wait(ctx, 1, 100*time.Millisecond).Result()
		return err == nil && n == 1, fmt.Sprint(n, err)
	})
	cfg := h.config()
	cfg.Redis = rdb
	cfg.RedisWaitReplicas, cfg.RedisWaitTimeout = 1, 100*time.Millisecond
	cfg.RedisMaxMemoryRatio = 0.5 // off until maxmemory is set
	cfg.MaxBackoff = 200 * time.Millisecond
	h.start(cfg)
	queued := func() []string { return h.queueJIDs("default") }

	replica.Signal(syscall.SIGSTOP)
	replicaStopped := true
	t.Cleanup(func() {
		if replicaStopped {
			replica.Signal(syscall.SIGCONT)
		}
	})
	b := h.stage(relay.Job{Name: "B"})
	h.waitLog("batch failed, retrying", 1) // B pushed, too few replicas: B stays staged, delivered
	if got := queued(); !slices.Equal(got, []string{b}) {
		t.Fatalf("queue holds %v, want B's push", got)
	}
	info, err := rdb.Info(ctx, "memory").Result()
	if err != nil {
		t.Fatal(err)
	}
	var used int64
	for line := range strings.SplitSeq(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "used_memory:"); ok {
			used, _ = strconv.ParseInt(v, 10, 64)
		}
	}
	// used / maxmemory is about 0.67: over the ratio, with room to spare.
	if err := rdb.ConfigSet(ctx, "maxmemory", fmt.Sprint(used*3/2)).Err(); err != nil {
		t.Fatal(err)
	}
	h.waitLog("backpressure: pushes paused, jobs wait in PostgreSQL", 1)
	c := h.stage(relay.Job{Name: "C"})
	// Retries of the batch of B and C, each of which runs the script to
	// WAIT for B's push.
	failed := h.logs.FilterMessage("batch failed, retrying").Len()
	h.waitLog("batch failed, retrying", failed+3)
	if got := queued(); !slices.Equal(got, []string{b}) {
		t.Fatalf("queue holds %v while Redis is over the memory ratio, want B's push only (C held)", got)
	}

	replica.Signal(syscall.SIGCONT)
	replicaStopped = false
	h.waitStaged(1) // B's row deleted; C's stays
	if got := queued(); !slices.Equal(got, []string{b}) {
		t.Fatalf("queue holds %v while Redis is over the memory ratio, want B's push only", got)
	}
	if err := rdb.ConfigSet(ctx, "maxmemory", "0").Err(); err != nil {
		t.Fatal(err)
	}
	h.waitStaged(0)
	if got := queued(); !slices.Equal(got, []string{b, c}) {
		t.Fatalf("queue holds %v, want B then C, each once", got)
	}
}

// With --target streams, --max-queue-length counts what the stream's
// consumer groups have not acknowledged (issue 22, section 3): XLEN counts
// the entries they took too, so a paused stream never resumed. A consumer
// group reads with XREADGROUP and XACKs: entries read and not acknowledged
// still count, and once they are acknowledged the relay resumes by itself,
// though XLEN is at the limit; each job is delivered exactly once.
func TestBackpressureStreamsResume(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	const limit = 3
	cfg := h.config()
	cfg.Target, cfg.MaxQueueLength, cfg.BatchSize = relay.TargetStreams, limit, 10
	stream := h.key("stream:default")
	if err := h.rdb.XGroupCreateMkStream(ctx, stream, "workers", "$").Err(); err != nil {
		t.Fatal(err)
	}
	jids := h.stageMany(jobsTo("default", 20, "")...)
	r := h.start(cfg)
	const pauseLine = "backpressure: pushes paused, jobs wait in PostgreSQL"
	h.waitLog(pauseLine, 1)
	h.waitStaged(20 - limit)
	if d := h.logs.FilterMessage(pauseLine).All()[0].ContextMap()["detail"]; d != "BACKPRESSURE "+stream+
		`: consumer group "workers" has 3 entries not acknowledged (lag + pending) >= --max-queue-length 3` {
		t.Fatalf("pause detail %q", d)
	}
	if n := h.rdb.XLen(ctx, stream).Val(); n != limit {
		t.Fatalf("%s holds %d entries, want %d (each job checks the count)", stream, n, limit)
	}

	var seen []string
	var readIDs []string
	readN := func(n int64) {
		t.Helper()
		res, err := h.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "workers", Consumer: "c1",
			Streams: []string{stream, ">"}, Count: n, Block: 100 * time.Millisecond}).Result()
		if errors.Is(err, redis.Nil) {
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range res[0].Messages {
			seen = append(seen, fmt.Sprint(m.Values["jid"]))
			readIDs = append(readIDs, m.ID)
		}
	}
	ackAll := func() {
		t.Helper()
		if len(readIDs) > 0 {
			if err := h.rdb.XAck(ctx, stream, "workers", readIDs...).Err(); err != nil {
				t.Fatal(err)
			}
			readIDs = nil
		}
	}
	// Read, not acknowledged: still 3 pending. Two looks (each claims a
	// batch and puts it back) find the stream still full.
	readN(limit)
	looks := func() int {
		n := 0
		for _, e := range h.logs.FilterMessage("batch drained").All() {
			if e.ContextMap()["left_staged"] != int64(0) {
				n++
			}
		}
		return n
	}
	before := looks()
	testenv.WaitFor(t, 15*time.Second, "two more looks at the paused stream", func() (bool, string) {
		return looks() >= before+2, fmt.Sprintf("%d looks", looks()-before)
	})
	if n := h.staged(); n != 20-limit || !slices.Equal(r.Status().Paused, []relay.Paused{{Queue: "default", Reason: "queue_length"}}) {
		t.Fatalf("%d staged, paused %v, while 3 entries are pending; want %d, default", n, r.Status().Paused, 20-limit)
	}

	// Acknowledged: the relay resumes, though XLEN is 3.
	ackAll()
	testenv.WaitFor(t, 60*time.Second, "the consumer group to take every job", func() (bool, string) {
		readN(10)
		ackAll()
		return len(seen) >= len(jids) && h.staged() == 0, fmt.Sprintf("%d of %d read, %d staged", len(seen), len(jids), h.staged())
	})
	h.waitLog("backpressure: pushes resumed", 1)
	slices.Sort(seen)
	if want := slices.Sorted(slices.Values(jids)); !slices.Equal(seen, want) {
		t.Fatalf("the group read %d jobs (%d distinct), want each of %d once", len(seen), len(slices.Compact(slices.Clone(seen))), len(want))
	}
	if n := h.rdb.XLen(ctx, stream).Val(); n != int64(len(jids)) {
		t.Fatalf("%s holds %d entries, want %d (acknowledged entries stay)", stream, n, len(jids))
	}
}

// With --target asynq, --max-queue-length holds tasks staged while asynq's
// pending list is full; a real asynq server started later takes them (the
// list shrinks as it does), the relay resumes by itself, and each task runs
// exactly once.
func TestBackpressureAsynqResume(t *testing.T) {
	t.Parallel()
	h, rdb, cfg := newAsynqHarness(t)
	const limit = 5
	cfg.MaxQueueLength, cfg.BatchSize = limit, 10
	jids := h.stageMany(jobsTo("default", 30, "")...)
	h.start(cfg)
	h.waitLog("backpressure: pushes paused, jobs wait in PostgreSQL", 1)
	h.waitStaged(30 - limit)
	if n := rdb.LLen(context.Background(), "asynq:{default}:pending").Val(); n != limit {
		t.Fatalf("asynq:{default}:pending holds %d tasks, want %d", n, limit)
	}

	var mu sync.Mutex
	ran := map[string]int{}
	mux := asynq.NewServeMux()
	mux.HandleFunc("TracedJob", func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		mu.Lock()
		ran[id]++
		mu.Unlock()
		return nil
	})
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Concurrency:       2,
		Queues:            map[string]int{"default": 1},
		TaskCheckInterval: 20 * time.Millisecond,
		LogLevel:          asynq.ErrorLevel,
	})
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	count := func() int {
		mu.Lock()
		defer mu.Unlock()
		return len(ran)
	}
	testenv.WaitFor(t, 60*time.Second, "asynq to run every task", func() (bool, string) {
		return count() >= len(jids) && h.staged() == 0, fmt.Sprintf("%d of %d ran, %d staged", count(), len(jids), h.staged())
	})
	h.waitLog("backpressure: pushes resumed", 1)
	mu.Lock()
	defer mu.Unlock()
	for _, jid := range jids {
		if ran[jid] != 1 {
			t.Fatalf("task %s ran %d times, want once (%d distinct ran)", jid, ran[jid], len(ran))
		}
	}
	if len(ran) != len(jids) {
		t.Fatalf("%d distinct tasks ran, want %d", len(ran), len(jids))
	}
}
