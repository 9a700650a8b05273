package relay_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// clusterRecords returns the fields of every record hash of h's schema on
// the cluster: one per slot the relay pushed to.
func clusterRecords(t *testing.T, h *harness, rdb *redis.ClusterClient, ns string) map[string]int {
	t.Helper()
	fence, _ := relay.HandoffKeys(ns, h.conn.Config().Database, h.schema)
	pattern := strings.TrimSuffix(fence, "fence") + "{*}:handoff"
	var mu sync.Mutex
	got := make(map[string]int)
	err := rdb.ForEachMaster(context.Background(), func(ctx context.Context, c *redis.Client) error {
		iter := c.Scan(ctx, 0, pattern, 100).Iterator()
		for iter.Next(ctx) {
			n, err := c.HLen(ctx, iter.Val()).Result()
			if err != nil {
				return err
			}
			mu.Lock()
			got[iter.Val()] = int(n)
			mu.Unlock()
		}
		return iter.Err()
	})
	if err != nil {
		t.Fatalf("scan the records: %v", err)
	}
	return got
}

// waitClusterRecordsEmpty waits until no record hash of h's schema holds a
// batch.
func waitClusterRecordsEmpty(t *testing.T, h *harness, rdb *redis.ClusterClient, ns string) {
	t.Helper()
	testenv.WaitFor(t, 15*time.Second, "empty handoff records", func() (bool, string) {
		recs := clusterRecords(t, h, rdb, ns)
		for _, n := range recs {
			if n > 0 {
				return false, fmt.Sprint(recs)
			}
		}
		return true, ""
	})
}

// On Redis Cluster, the asynq target pushes each batch as one atomic part
// per hash slot, each fenced and recorded in its slot: a leader that
// pushed jobs of queues spread over the cluster and died before its delete
// committed leaves them staged, and the next leader deletes them without
// pushing them again. The streams target drains too; the sidekiq target is
// refused.
func TestRedisCluster(t *testing.T) {
	t.Parallel()
	cluster := testenv.StartRedisCluster(t)

	t.Run("asynq, each job once across leaderships", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		rdb := cluster.Client(t)
		ctx := context.Background()
		var queues []string
		slots := make(map[int64]bool)
		for i := range 6 {
			q := fmt.Sprintf("%s-q%d", h.schema, i)
			queues = append(queues, q)
			slots[rdb.ClusterKeySlot(ctx, "asynq:{"+q+"}:pending").Val()] = true
		}
		if len(slots) < 3 {
			t.Fatalf("the queues are in %d slots, want them spread", len(slots))
		}
		var jobs []relay.Job
		for i := range 30 {
			j := relay.Job{Name: "Work", Args: []any{i}, Queue: queues[i%len(queues)]}
			if i%5 == 0 {
				j.RunAt = time.Now().Add(time.Hour)
			}
			jobs = append(jobs, j)
		}
		h.stageMany(jobs...)
		cfg := h.config()
		cfg.Redis, cfg.RedisNamespace, cfg.Target = rdb, "", relay.TargetAsynq

		// The first leader dies between its push and its delete.
		first, err := relay.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		relay.SetAfterPush(first, func(context.Context) error {
			cancel()
			return errors.New("injected crash after push")
		})
		if err := first.Run(rctx); err != nil {
			t.Fatalf("first relay: %v", err)
		}
		if n := h.staged(); n != 30 {
			t.Fatalf("%d rows staged after the crash, want all 30", n)
		}
		tasks := func() (n int64) {
			for _, q := range queues {
				n += rdb.LLen(ctx, "asynq:{"+q+"}:pending").Val() + rdb.ZCard(ctx, "asynq:{"+q+"}:scheduled").Val()
			}
			return n
		}
		if n := tasks(); n != 30 {
			t.Fatalf("the first relay pushed %d tasks, want 30", n)
		}
		if recs := clusterRecords(t, h, rdb, ""); len(recs) < 3 {
			t.Fatalf("records %v, want one per slot pushed to", recs)
		}

		// The next leader.
		cfg = h.config()
		cfg.Redis, cfg.RedisNamespace, cfg.Target = rdb, "", relay.TargetAsynq
		h.start(cfg)
		h.waitStaged(0)
		waitClusterRecordsEmpty(t, h, rdb, "")
		if n := tasks(); n != 30 {
			t.Fatalf("after the next leader, %d tasks, want each of the 30 once", n)
		}
		already := 0
		for _, e := range h.logs.FilterMessage("batch drained").All() {
			if n, ok := e.ContextMap()["already_pushed"].(int64); ok {
				already += int(n)
			}
		}
		if already != 30 {
			t.Fatalf("the next leader counted %d jobs already pushed, want 30; logs %v", already, messages(h.logs))
		}
		names, err := rdb.SMembers(ctx, "asynq:queues").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range queues {
			if !strings.Contains(strings.Join(names, "\n")+"\n", q+"\n") {
				t.Errorf("asynq:queues %v lacks %s", names, q)
			}
		}
	})

	t.Run("an asynq server on the cluster runs the tasks", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		rdb := cluster.Client(t)
		seen := make(chan string, 20)
		mux := asynq.NewServeMux()
		mux.HandleFunc("Work", func(ctx context.Context, task *asynq.Task) error {
			queue, _ := asynq.GetQueueName(ctx)
			seen <- queue + " " + string(task.Payload())
			return nil
		})
		queues := map[string]int{}
		var jobs []relay.Job
		for i := range 8 {
			q := fmt.Sprintf("%s-run%d", h.schema, i%4)
			queues[q] = 1
			jobs = append(jobs, relay.Job{Name: "Work", Args: []any{i}, Queue: q})
		}
		srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
			Concurrency: 2, Queues: queues, TaskCheckInterval: 20 * time.Millisecond, LogLevel: asynq.ErrorLevel,
		})
		if err := srv.Start(mux); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(srv.Shutdown)
		cfg := h.config()
		cfg.Redis, cfg.RedisNamespace, cfg.Target = rdb, "", relay.TargetAsynq
		h.start(cfg)
		h.stageMany(jobs...)
		got := make(map[string]bool)
		for range jobs {
			select {
			case s := <-seen:
				got[s] = true
			case <-time.After(15 * time.Second):
				t.Fatalf("the asynq server ran %d of %d tasks within 15s: %v", len(got), len(jobs), got)
			}
		}
		for i, j := range jobs {
			if want := fmt.Sprintf("%s [%d]", j.Queue, i); !got[want] {
				t.Errorf("no task %q ran; ran %v", want, got)
			}
		}
	})

	t.Run("streams", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		rdb := cluster.Client(t)
		cfg := h.config()
		cfg.Redis, cfg.Target = rdb, relay.TargetStreams
		h.start(cfg)
		var jobs []relay.Job
		for i := range 12 {
			jobs = append(jobs, relay.Job{Name: "Work", Args: []any{i}, Queue: fmt.Sprintf("s%d", i%4)})
		}
		h.stageMany(jobs...)
		h.waitStaged(0)
		for i := range 4 {
			key := fmt.Sprintf("%s:stream:s%d", h.ns, i)
			if n := rdb.XLen(context.Background(), key).Val(); n != 3 {
				t.Errorf("%s holds %d entries, want 3", key, n)
			}
		}
		waitClusterRecordsEmpty(t, h, rdb, h.ns)
	})

	// BullMQ's keys share a slot through a hash tag in the prefix or in
	// the queue's name; a job of a queue with neither is dead-lettered.
	t.Run("bullmq", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		rdb := cluster.Client(t)
		ctx := context.Background()
		cfg := h.config()
		cfg.Redis, cfg.Target = rdb, relay.TargetBullMQ // prefix h.ns, no hash tag
		tagged := h.stageMany(
			relay.Job{Name: "Work", Args: []any{1}, Queue: "{b1}"},
			relay.Job{Name: "Work", Args: []any{2}, Queue: "{b2}", RunAt: time.Now().Add(time.Hour)},
			relay.Job{Name: "Work", Args: []any{3}, Queue: "plain"},
		)
		h.start(cfg)
		h.waitStaged(0)
		if rdb.LLen(ctx, h.ns+":{b1}:wait").Val() != 1 || rdb.ZScore(ctx, h.ns+":{b2}:delayed", tagged[1]).Err() != nil {
			t.Errorf("the jobs of the queues {b1} and {b2} are not in their wait list and delayed set")
		}
		var reason string
		if err := h.conn.QueryRow(ctx, "SELECT reason FROM "+pgx.Identifier{h.schema, "staged_jobs_dead"}.Sanitize()+" WHERE jid = $1", tagged[2]).Scan(&reason); err != nil {
			t.Fatalf("the job of queue plain is not dead-lettered: %v", err)
		}
		if !strings.Contains(reason, "share a slot only with a hash tag") {
			t.Errorf("the job of queue plain is dead-lettered for %q, want the hash tag's reason", reason)
		}

		// A hash tag in the prefix: every queue in one slot.
		h2 := newHarness(t)
		cfg = h2.config()
		cfg.Redis, cfg.Target, cfg.RedisNamespace = rdb, relay.TargetBullMQ, "{"+h2.ns+"}"
		h2.stageMany(relay.Job{Name: "Work", Args: []any{1}, Queue: "a"}, relay.Job{Name: "Work", Args: []any{2}, Queue: "b"})
		h2.start(cfg)
		h2.waitStaged(0)
		for _, q := range []string{"a", "b"} {
			if n := rdb.LLen(ctx, "{"+h2.ns+"}:"+q+":wait").Val(); n != 1 {
				t.Errorf("queue %s's wait list holds %d jobs, want 1", q, n)
			}
		}
	})

	t.Run("a single-server client of a cluster node refused", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		cfg := h.config()
		node := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", cluster.Nodes[0].Port), DisableIdentity: true})
		t.Cleanup(func() { _ = node.Close() })
		cfg.Redis, cfg.Target = node, relay.TargetStreams
		r, err := relay.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
		defer cancel()
		if err := r.Run(ctx); err == nil || !strings.Contains(err.Error(), "is a Redis Cluster node") {
			t.Fatalf("Run on a cluster node through a single-server client: %v, want a refusal", err)
		}
	})

	t.Run("sidekiq and a Ring refused", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		cfg := h.config()
		cfg.Redis = cluster.Client(t)
		_, err := relay.New(cfg)
		var fe *relay.FieldError
		if !errors.As(err, &fe) || fe.Field != "Redis" || !strings.Contains(fe.Reason, "Sidekiq does not support Redis Cluster") {
			t.Fatalf("relay.New with the sidekiq target on a cluster: %v, want a Redis field error", err)
		}
		ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}})
		t.Cleanup(func() { _ = ring.Close() })
		cfg.Redis, cfg.Target = ring, relay.TargetStreams
		if _, err := relay.New(cfg); !errors.As(err, &fe) || fe.Field != "Redis" || !strings.Contains(fe.Reason, "Ring") {
			t.Fatalf("relay.New with a Ring: %v, want a Redis field error", err)
		}
	})
}

// Through Sentinel, the relay pushes to the primary the sentinel names, as
// to a single Redis.
func TestRedisSentinel(t *testing.T) {
	t.Parallel()
	primary := testenv.StartRedis(t)
	sentinel := testenv.StartRedisSentinel(t, primary.Port)
	h := newHarness(t)
	o, err := redis.ParseFailoverURL(sentinel.URL())
	if err != nil {
		t.Fatal(err)
	}
	o.DisableIdentity = true
	rdb := redis.NewFailoverClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	cfg := h.config()
	cfg.Redis = rdb
	h.start(cfg)
	jids := h.stageMany(relay.Job{Name: "A"}, relay.Job{Name: "B"})
	h.waitStaged(0)
	direct := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", primary.Port), DisableIdentity: true})
	defer direct.Close()
	got, err := direct.LRange(context.Background(), h.key("queue:default"), 0, -1).Result()
	if err != nil || len(got) != 2 || !strings.Contains(got[0]+got[1], jids[0]) || !strings.Contains(got[0]+got[1], jids[1]) {
		t.Fatalf("the primary's queue:default %v, %v; want the 2 jobs", got, err)
	}
	if lines := h.logs.FilterMessage("became leader").All(); len(lines) == 0 {
		t.Fatalf("no leader; logs %v", messages(h.logs))
	}
	for _, e := range h.logs.All() {
		if r, ok := e.ContextMap()["redis"]; ok && r != "sentinel primary/0" {
			t.Errorf("log %q names Redis %q, want sentinel primary/0", e.Message, r)
		}
	}
}

// When Sentinel fails the primary over to its replica, the relay's batches
// fail while there is no primary (their rows stay staged), then go to the
// new primary: each job lands once.
func TestRedisSentinelFailover(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	primary := testenv.StartRedis(t)
	replica := testenv.StartRedis(t, "--replicaof", "127.0.0.1", fmt.Sprint(primary.Port))
	onReplica := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", replica.Port), DisableIdentity: true})
	defer onReplica.Close()
	testenv.WaitFor(t, 15*time.Second, "the replica in sync", func() (bool, string) {
		info := onReplica.Info(ctx, "replication").Val()
		return strings.Contains(info, "master_link_status:up"), info
	})
	sentinel := testenv.StartRedisSentinel(t, primary.Port)
	sc := redis.NewSentinelClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", sentinel.Port), DisableIdentity: true})
	defer sc.Close()
	testenv.WaitFor(t, 20*time.Second, "the sentinel to know the replica", func() (bool, string) {
		rs, err := sc.Replicas(ctx, "mymaster").Result()
		return err == nil && len(rs) == 1, fmt.Sprint(rs, err)
	})

	h := newHarness(t)
	o, err := redis.ParseFailoverURL(sentinel.URL())
	if err != nil {
		t.Fatal(err)
	}
	o.DisableIdentity, o.MaxRetries, o.DialerRetries = true, 1, 1
	rdb := redis.NewFailoverClient(o)
	t.Cleanup(func() { _ = rdb.Close() })
	cfg := h.config()
	cfg.Redis = rdb
	h.start(cfg)
	before := h.stage(relay.Job{Name: "Before"})
	h.waitStaged(0)
	queue := h.key("queue:default")
	testenv.WaitFor(t, 10*time.Second, "the job on the replica", func() (bool, string) {
		n := onReplica.LLen(ctx, queue).Val()
		return n == 1, fmt.Sprint(n)
	})

	primary.Stop()
	after := h.stage(relay.Job{Name: "After"})
	testenv.WaitFor(t, 60*time.Second, "the job staged during the failover drained", func() (bool, string) {
		n := h.staged()
		return n == 0, fmt.Sprintf("%d staged", n)
	})
	got, err := onReplica.LRange(ctx, queue, 0, -1).Result()
	if err != nil || len(got) != 2 || !strings.Contains(got[1], before) || !strings.Contains(got[0], after) {
		t.Fatalf("the new primary's queue %v, %v; want %s then %s, once each", got, err, before, after)
	}
	if role := onReplica.Info(ctx, "replication").Val(); !strings.Contains(role, "role:master") {
		t.Fatalf("the replica was not promoted: %s", role)
	}
}
