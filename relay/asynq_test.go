package relay_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zapcore"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// asynqHarness is a harness whose relay writes asynq tasks to a private
// redis-server: asynq's key names are fixed, so no namespace can keep two
// tests apart.
func newAsynqHarness(t *testing.T) (*harness, *redis.Client, relay.Config) {
	h := newHarness(t)
	srv := testenv.StartRedis(t)
	opts, _ := redis.ParseURL(srv.URL())
	rdb := redis.NewClient(testenv.RedisOptions(opts))
	t.Cleanup(func() { _ = rdb.Close() })
	cfg := h.config()
	cfg.Redis, cfg.RedisNamespace, cfg.Target = rdb, "", relay.TargetAsynq
	return h, rdb, cfg
}

// handled is a task an asynq handler was called with.
type handled struct {
	typename, payload, id, queue string
	maxRetry                     int
	headers                      map[string]string
	at                           time.Time
}

// A real asynq server runs the tasks the relay wrote: with the job's name as
// the task type, its args as the payload, its jid as the task id, in its
// queue, with its options; an immediate job at once, a scheduled one once
// its run_at has come (asynq schedules by whole seconds).
func TestAsynqServerRunsStagedJobs(t *testing.T) {
	t.Parallel()
	h, rdb, cfg := newAsynqHarness(t)
	seen := make(chan handled, 10)
	mux := asynq.NewServeMux()
	mux.HandleFunc("WelcomeEmail", func(ctx context.Context, task *asynq.Task) error {
		id, _ := asynq.GetTaskID(ctx)
		queue, _ := asynq.GetQueueName(ctx)
		retry, _ := asynq.GetMaxRetry(ctx)
		seen <- handled{task.Type(), string(task.Payload()), id, queue, retry, task.Headers(), time.Now()}
		return nil
	})
	srv := asynq.NewServerFromRedisClient(rdb, asynq.Config{
		Concurrency:              2,
		Queues:                   map[string]int{"mailers": 1, "default": 1},
		TaskCheckInterval:        20 * time.Millisecond,
		DelayedTaskCheckInterval: 100 * time.Millisecond,
		LogLevel:                 asynq.ErrorLevel,
	})
	if err := srv.Start(mux); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Shutdown)
	h.start(cfg)

	runAt := time.Now().Add(1500 * time.Millisecond)
	jids := h.stageMany(
		relay.Job{Name: "WelcomeEmail", Args: []any{42, "ada@example.com"}, Queue: "mailers",
			Options: map[string]any{"retry": 3, "headers": map[string]string{"trace": "t-1"}}},
		relay.Job{Name: "WelcomeEmail", Args: []any{map[string]any{"user": 7}}, RunAt: runAt},
	)
	wait := func() handled {
		t.Helper()
		select {
		case got := <-seen:
			return got
		case <-time.After(15 * time.Second):
			t.Fatalf("no task handled within 15s; logs: %v", messages(h.logs))
			return handled{}
		}
	}
	now := wait()
	if now.typename != "WelcomeEmail" || now.payload != `[42, "ada@example.com"]` || now.id != jids[0] ||
		now.queue != "mailers" || now.maxRetry != 3 || now.headers["trace"] != "t-1" {
		t.Errorf("immediate task: %+v, want type WelcomeEmail, payload [42, \"ada@example.com\"], id %s, queue mailers, retry 3, header trace t-1", now, jids[0])
	}
	later := wait()
	if later.typename != "WelcomeEmail" || later.payload != `[{"user": 7}]` || later.id != jids[1] ||
		later.queue != "default" || later.maxRetry != 25 {
		t.Errorf("scheduled task: %+v, want type WelcomeEmail, payload [{\"user\": 7}], id %s, queue default, retry 25", later, jids[1])
	}
	if due := runAt.Truncate(time.Second); later.at.Before(due) {
		t.Errorf("scheduled task ran at %s, before its run_at %s (in whole seconds: %s)", later.at, runAt, due)
	}
	h.waitStaged(0)
}

// A row pushed again with the jid of a task that still exists (a
// redelivery) is skipped, not a second task; so is a row whose unique lock
// is held (a duplicate, as asynq's client refuses it). Both rows are
// deleted.
func TestAsynqSameJIDMakesOneTask(t *testing.T) {
	t.Parallel()
	h, rdb, cfg := newAsynqHarness(t)
	h.start(cfg)
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	insert := func(jid, args, options string) {
		t.Helper()
		_, err := h.conn.Exec(context.Background(), `INSERT INTO `+table+
			` (job_name, job_args, queue, jid, options) VALUES ('Charge', $1, 'billing', $2, $3)`, args, jid, options)
		if err != nil {
			t.Fatal(err)
		}
		h.waitStaged(0)
	}
	insert("charge-1", `[1]`, `{}`)
	insert("charge-1", `[2]`, `{}`)             // the same jid: the task exists
	insert("charge-2", `[9]`, `{"unique": 60}`) // a new unique task
	insert("charge-3", `[9]`, `{"unique": 60}`) // its duplicate

	inspector := asynq.NewInspectorFromRedisClient(rdb)
	tasks, err := inspector.ListPendingTasks("billing")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, task := range tasks {
		got = append(got, task.ID+" "+string(task.Payload))
	}
	if len(got) != 2 || got[0] != "charge-1 [1]" || got[1] != "charge-2 [9]" {
		t.Fatalf("pending tasks %q, want [charge-1 [1] charge-2 [9]]", got)
	}
	if n := rdb.LLen(context.Background(), "asynq:{billing}:pending").Val(); n != 2 {
		t.Fatalf("%d ids in the pending list, want 2", n)
	}
	// A batch's line is logged after its commit, which waitStaged sees
	// first: wait for the lines of both skips.
	skipped := func() int {
		n := 0
		for _, e := range h.logs.FilterMessage("batch drained").All() {
			if k, ok := e.ContextMap()["skipped"].(int64); ok {
				n += int(k)
			}
		}
		return n
	}
	testenv.WaitFor(t, 10*time.Second, "the batches' lines counting 2 jobs skipped", func() (bool, string) {
		n := skipped()
		return n >= 2, fmt.Sprintf("%d skipped", n)
	})
	if n := skipped(); n != 2 {
		t.Errorf("batches counted %d jobs skipped, want 2", n)
	}
	if n := h.logs.FilterLevelExact(zapcore.ErrorLevel).Len(); n != 0 {
		t.Errorf("%d error lines, want none: %v", n, messages(h.logs))
	}
}
