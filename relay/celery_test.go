package relay_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// celeryWorker is a real Celery worker (Debian's python3-celery 5.2, run
// by Debian's own /usr/bin/python3) on testdata/celery/tasks.py.
type celeryWorker struct {
	mu  sync.Mutex
	out bytes.Buffer
}

func (w *celeryWorker) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.out.Write(p)
}

func (w *celeryWorker) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.out.String()
}

// startCeleryWorker starts `celery worker -Q queues --pool solo` reading
// redisURL, with Kombu's global_keyprefix set to prefix, recording each
// task it runs onto the list prefix+recordKey. It is killed, with its
// process group, when the test ends.
func startCeleryWorker(t *testing.T, redisURL, prefix, recordKey string, queues ...string) *celeryWorker {
	t.Helper()
	dir, err := filepath.Abs(filepath.Join("testdata", "celery"))
	if err != nil {
		t.Fatal(err)
	}
	w := &celeryWorker{}
	cmd := exec.Command("/usr/bin/python3", "-m", "celery", "-A", "tasks", "worker", "-Q", strings.Join(queues, ","),
		"--pool", "solo", "--without-mingle", "--without-gossip", "--without-heartbeat", "--loglevel", "INFO")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CELERY_BROKER_URL="+redisURL, "CELERY_KEYPREFIX="+prefix,
		"CELERY_RECORD_KEY="+recordKey, "PYTHONDONTWRITEBYTECODE=1", "PYTHONPATH="+dir)
	cmd.Stdout, cmd.Stderr = w, w
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the celery worker (Debian: apt-get install python3-celery python3-redis): %v", err)
	}
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	})
	return w
}

// celeryRun is what testdata/celery/tasks.py recorded of one task run.
type celeryRun struct {
	ID          string          `json:"id"`
	Task        string          `json:"task"`
	Args        json.RawMessage `json:"args"`
	Kwargs      json.RawMessage `json:"kwargs"`
	Queue       string          `json:"queue"`
	Priority    *int            `json:"priority"`
	Traceparent *string         `json:"traceparent"`
	Apartment   *string         `json:"apartment"`
	RanAt       float64         `json:"ran_at"`
}

// A real Celery worker runs what the relay pushes, each job once, with the
// args, kwargs, queue and id that were staged in the app's transactions:
// immediate, in a queue of its own with a priority (Kombu's priority
// list) and a trace context, scheduled (held in PostgreSQL until its
// run_at, then run at once); a job whose transaction rolled back never
// runs, an expired one is discarded by the worker, and a row whose kwargs
// are not an object is dead-lettered. Once with no namespace, once with
// --redis-namespace, which the worker reads with Kombu's global_keyprefix,
// and --tenant-key apartment, a header the worker puts on task.request.
func TestCeleryRealWorkerRunsEachJobOnce(t *testing.T) {
	t.Parallel()
	for _, ns := range []string{"", "myapp"} {
		t.Run("namespace="+ns, func(t *testing.T) {
			t.Parallel()
			testCeleryRealWorker(t, ns)
		})
	}
}

func testCeleryRealWorker(t *testing.T, ns string) {
	ctx := context.Background()
	h := newHarness(t)
	srv := testenv.StartRedis(t) // the test's own Redis: the worker's keys are Kombu's own
	opts, _ := redis.ParseURL(srv.URL())
	rdb := redis.NewClient(testenv.RedisOptions(opts))
	t.Cleanup(func() { _ = rdb.Close() })
	prefix := ""
	if ns != "" {
		prefix = ns + ":"
	}
	worker := startCeleryWorker(t, srv.URL(), prefix, "runs", "celery", "mail")
	cfg := h.config()
	cfg.Redis, cfg.RedisNamespace, cfg.Target = rdb, ns, relay.TargetCelery
	tenant := ""
	if ns != "" {
		cfg.TenantKey, tenant = "apartment", h.schema
	}
	h.start(cfg)

	// Staged as a Django view would, in the app's own transactions.
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	stage := func(commit bool, args, queue, runAt, options string) string {
		t.Helper()
		tx, err := h.conn.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var jid string
		if err := tx.QueryRow(ctx, `INSERT INTO `+table+` (job_name, job_args, queue, run_at, options)
			VALUES ('tasks.record', $1::jsonb, $2, now() + $3::interval, $4::jsonb) RETURNING jid`,
			args, queue, runAt, options).Scan(&jid); err != nil {
			t.Fatal(err)
		}
		if commit {
			err = tx.Commit(ctx)
		} else {
			err = tx.Rollback(ctx)
		}
		if err != nil {
			t.Fatal(err)
		}
		return jid
	}
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	plain := stage(true, `[1, "ada@example.com"]`, "celery", "0s", `{}`)
	mail := stage(true, `[2]`, "mail", "0s", `{"kwargs": {"greeting": "hi"}, "priority": 5, "traceparent": "`+tp+`"}`)
	scheduled := stage(true, `[3]`, "celery", "3s", `{}`)
	var runAt time.Time
	if err := h.conn.QueryRow(ctx, `SELECT run_at FROM `+table+` WHERE jid = $1`, scheduled).Scan(&runAt); err != nil {
		t.Fatalf("the scheduled job is not staged right after its commit (pushed early?): %v", err)
	}
	rolledBack := stage(false, `[4]`, "celery", "0s", `{}`)
	expired := stage(true, `[5]`, "celery", "0s", `{"expires": "2020-01-01T00:00:00Z"}`)
	poison := stage(true, `[6]`, "celery", "0s", `{"kwargs": [1]}`)

	runs := func() []celeryRun {
		raw, err := rdb.LRange(ctx, prefix+"runs", 0, -1).Result()
		if err != nil {
			t.Fatalf("LRANGE runs: %v", err)
		}
		out := make([]celeryRun, len(raw))
		for i, s := range raw {
			if err := json.Unmarshal([]byte(s), &out[i]); err != nil {
				t.Fatalf("run record %q: %v", s, err)
			}
		}
		return out
	}
	var got []celeryRun
	testenv.WaitFor(t, 60*time.Second, "the worker to run the 3 jobs, the scheduled one too, and to discard the expired one", func() (bool, string) {
		got = runs()
		discarded := strings.Contains(worker.String(), "Discarding revoked task: tasks.record["+expired+"]")
		return len(got) >= 3 && discarded, fmt.Sprintf("ran %+v, expired discarded %v; worker output:\n%s\nrelay logs: %v",
			got, discarded, worker.String(), messages(h.logs))
	})
	// Then nothing is left to run: no row staged, no message in a list or
	// held unacknowledged by Kombu.
	left := func() string {
		var staged int
		if err := h.conn.QueryRow(ctx, `SELECT count(*) FROM `+table).Scan(&staged); err != nil {
			t.Fatal(err)
		}
		var out []string
		if staged != 0 {
			out = append(out, fmt.Sprintf("%d rows staged", staged))
		}
		keys, err := rdb.Keys(ctx, prefix+"*").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, k := range keys {
			var n int64
			switch {
			case strings.HasPrefix(k, prefix+"celery") || strings.HasPrefix(k, prefix+"mail"):
				n, _ = rdb.LLen(ctx, k).Result()
			case k == prefix+"unacked":
				n, _ = rdb.HLen(ctx, k).Result()
			}
			if n != 0 {
				out = append(out, fmt.Sprintf("%q holds %d messages", k, n))
			}
		}
		return strings.Join(out, "; ")
	}
	testenv.WaitFor(t, 15*time.Second, "no job left staged, queued or unacknowledged", func() (bool, string) {
		s := left()
		return s == "", s
	})
	got = runs()

	byID := map[string][]celeryRun{}
	for _, r := range got {
		byID[r.ID] = append(byID[r.ID], r)
	}
	for _, jid := range []string{rolledBack, expired, poison} {
		if len(byID[jid]) != 0 {
			t.Errorf("job %s ran %d times, want never (rolled back, expired, dead-lettered)", jid, len(byID[jid]))
		}
	}
	type want struct {
		jid, args, kwargs, queue string
		priority                 int
		traceparent              string
	}
	for _, w := range []want{
		{plain, `[1, "ada@example.com"]`, `{}`, "celery", 0, ""},
		{mail, `[2]`, `{"greeting": "hi"}`, "mail", 5, tp},
		{scheduled, `[3]`, `{}`, "celery", 0, ""},
	} {
		rs := byID[w.jid]
		if len(rs) != 1 {
			t.Errorf("job %s ran %d times, want once; runs: %+v", w.jid, len(rs), got)
			continue
		}
		r := rs[0]
		var tpSeen, tenantSeen string
		if r.Traceparent != nil {
			tpSeen = *r.Traceparent
		}
		if r.Apartment != nil {
			tenantSeen = *r.Apartment
		}
		if tenantSeen != tenant {
			t.Errorf("job %s: the worker saw self.request.apartment %q, want %q", w.jid, tenantSeen, tenant)
		}
		if r.Task != "tasks.record" || compactJSON(t, r.Args) != compactJSON(t, []byte(w.args)) ||
			compactJSON(t, r.Kwargs) != compactJSON(t, []byte(w.kwargs)) || r.Queue != w.queue ||
			r.Priority == nil || *r.Priority != w.priority || tpSeen != w.traceparent {
			t.Errorf("job %s: the worker ran %s(*%s, **%s) from queue %s, priority %v, traceparent %q; want tasks.record(*%s, **%s) from %s, priority %d, traceparent %q",
				w.jid, r.Task, r.Args, r.Kwargs, r.Queue, r.Priority, tpSeen, w.args, w.kwargs, w.queue, w.priority, w.traceparent)
		}
	}
	if rs := byID[scheduled]; len(rs) == 1 {
		ran := time.UnixMicro(int64(rs[0].RanAt * 1e6))
		if ran.Before(runAt) {
			t.Errorf("the scheduled job ran at %s, before its run_at %s: it was pushed early", ran.Format(time.RFC3339Nano), runAt.Format(time.RFC3339Nano))
		}
	}
	var reason string
	if err := h.conn.QueryRow(ctx, `SELECT reason FROM `+pgx.Identifier{h.schema, "staged_jobs_dead"}.Sanitize()+` WHERE jid = $1`, poison).Scan(&reason); err != nil {
		t.Fatalf("the row whose kwargs is an array is not dead-lettered: %v", err)
	}
	if !strings.Contains(reason, `options "kwargs" must be a JSON object`) {
		t.Errorf("dead-letter reason %q, want it to say kwargs must be a JSON object", reason)
	}
}

func compactJSON(t *testing.T, b []byte) string {
	t.Helper()
	var v any
	if err := json.Unmarshal(b, &v); err != nil {
		t.Fatalf("%s: %v", b, err)
	}
	out, _ := json.Marshal(v)
	return string(out)
}

// With --max-queue-length, a Celery queue's length is its list and its
// priority lists together, as Kombu's _size counts them: a job of priority
// 0 waits in PostgreSQL while the queue's priority-9 list holds the limit,
// and goes once a worker has taken from it.
func TestCeleryBackpressureCountsPriorityLists(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	cfg := h.config()
	cfg.Target, cfg.MaxQueueLength = relay.TargetCelery, 2
	high := h.key("work\x06\x169") // Kombu's list of priority 9
	if err := h.rdb.RPush(ctx, high, "m1", "m2").Err(); err != nil {
		t.Fatal(err)
	}
	h.start(cfg)
	h.stage(relay.Job{Name: "tasks.record", Queue: "work", Args: []any{1}})
	h.waitLog("backpressure: pushes paused, jobs wait in PostgreSQL", 1)
	paused := h.logs.FilterMessage("backpressure: pushes paused, jobs wait in PostgreSQL").All()[0]
	if d, want := paused.ContextMap()["detail"], "BACKPRESSURE "+h.key("work")+" (with 3 more keys) holds 2 >= --max-queue-length 2"; d != want {
		t.Fatalf("pause detail %q, want %q", d, want)
	}
	if n := h.staged(); n != 1 {
		t.Fatalf("%d rows staged while the queue is full, want 1", n)
	}
	if err := h.rdb.RPop(ctx, high).Err(); err != nil { // a worker takes one
		t.Fatal(err)
	}
	h.waitStaged(0)
	if n := h.rdb.LLen(ctx, h.key("work")).Val(); n != 1 {
		t.Fatalf("list %s holds %d messages after the resume, want 1", h.key("work"), n)
	}
}
