package relay_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// bullmqDir holds the real BullMQ worker the tests run: package.json and
// package-lock.json pin bullmq, and npm ci installs it (bullmqInstall).
var bullmqDir = filepath.Join("testdata", "bullmq")

var bullmqInstall = sync.OnceValue(func() error {
	if _, err := os.Stat(filepath.Join(bullmqDir, "node_modules", "bullmq", "package.json")); err == nil {
		return nil
	}
	cmd := exec.Command("npm", "ci", "--no-audit", "--no-fund")
	cmd.Dir = bullmqDir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("npm ci in %s (Node and npm are needed: apt-get install nodejs npm): %v\n%s", bullmqDir, err, out)
	}
	return nil
})

// bullmqRun is a job a BullMQ Worker ran, as worker.js writes it.
type bullmqRun struct {
	Ready       bool            `json:"ready"`
	Queue       string          `json:"queue"`
	ID          string          `json:"id"`
	Name        string          `json:"name"`
	Data        json.RawMessage `json:"data"`
	Opts        map[string]any  `json:"opts"`
	Timestamp   int64           `json:"timestamp"`
	ProcessedOn int64           `json:"processedOn"`
}

// startBullmqWorker runs BullMQ Workers (worker.js on Node) over queues
// under prefix, on the test Redis, until the test ends, and returns the
// jobs they run as they run them.
func startBullmqWorker(t *testing.T, prefix string, queues ...string) <-chan bullmqRun {
	t.Helper()
	if err := bullmqInstall(); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("node", "worker.js")
	cmd.Dir = bullmqDir
	cmd.Env = append(os.Environ(), "REDIS_URL="+testenv.RedisURL(), "PREFIX="+prefix, "QUEUES="+strings.Join(queues, ","))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start the BullMQ worker: %v", err)
	}
	runs := make(chan bullmqRun, 100)
	ready := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			var r bullmqRun
			if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
				t.Errorf("BullMQ worker wrote %q: %v", sc.Text(), err)
				continue
			}
			if r.Ready {
				close(ready)
				continue
			}
			runs <- r
		}
		_, _ = io.Copy(io.Discard, stdout)
	}()
	t.Cleanup(func() {
		_ = stdin.Close() // worker.js closes its workers and exits
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		_ = cmd.Wait()
		if stderr.Len() > 0 {
			t.Logf("BullMQ worker's stderr: %s", stderr.String())
		}
	})
	select {
	case <-ready:
	case <-done:
		t.Fatalf("the BullMQ worker exited before it was ready: %s", stderr.String())
	case <-time.After(30 * time.Second):
		t.Fatalf("the BullMQ worker was not ready within 30s: %s", stderr.String())
	}
	return runs
}

// stageFromNode runs the README's "From Node" example (stage.js, with
// node-postgres) in h's schema, committed or rolled back, and returns the
// jid it printed ("" when rolled back).
func stageFromNode(t *testing.T, h *harness, rollback bool) string {
	t.Helper()
	cmd := exec.Command("node", "stage.js")
	cmd.Dir = bullmqDir
	cmd.Env = append(os.Environ(), "DATABASE_URL="+testenv.DatabaseURL(), "SCHEMA="+h.schema)
	if rollback {
		cmd.Env = append(cmd.Env, "ROLLBACK=1")
	}
	out, err := cmd.Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("node stage.js: %v: %s", err, stderr)
	}
	return strings.TrimSpace(string(out))
}

// The README's "From Node" example is what stage.js runs: the lines
// between its markers, but for those ending "// test only".
func TestBullMQReadmeNodeExample(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile(filepath.Join("..", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, _ := strings.Cut(string(readme), "### From Node\n")
	_, block, _ := strings.Cut(section, "```js\n")
	block, _, _ = strings.Cut(block, "```")
	script, err := os.ReadFile(filepath.Join(bullmqDir, "stage.js"))
	if err != nil {
		t.Fatal(err)
	}
	_, example, _ := strings.Cut(string(script), "// --- the README's example, from here\n")
	example, _, _ = strings.Cut(example, "// --- to here")
	lines := func(s string) []string {
		var out []string
		for l := range strings.Lines(s) {
			if l = strings.TrimSpace(l); l != "" && !strings.HasSuffix(l, "// test only") {
				out = append(out, l)
			}
		}
		return out
	}
	if got, want := lines(example), lines(block); strings.Join(got, "\n") != strings.Join(want, "\n") || len(want) < 5 {
		t.Fatalf("stage.js runs\n%s\nbut the README's From Node example is\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}

// A real BullMQ Worker (bullmq 6.7.0 on Node) runs every job the relay
// pushed exactly once, with the name, data, queue, job id and options that
// were staged: immediate jobs in two queues, a prioritized one, a delayed
// one (not before its run_at), one staged from Node with node-postgres as
// the README shows (its data an object, by unwrapData); a job staged in a
// transaction that rolled back, from Go or from Node, never runs.
func TestBullMQWorkerRunsStagedJobs(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	cfg.Target = relay.TargetBullMQ // h.ns is BullMQ's prefix
	runs := startBullmqWorker(t, h.ns, "mailers", "default")
	h.start(cfg)
	ctx := context.Background()

	// Rolled back: from Go and from Node.
	tx, err := h.conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rolledBack, err := h.stager.Stage(ctx, tx, relay.Job{Name: "welcome", Args: []any{"rolled back"}, Queue: "default"})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if jid := stageFromNode(t, h, true); jid != "" {
		t.Fatalf("stage.js rolled back printed jid %q, want none", jid)
	}

	const traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	runAt := time.Now().Add(1500 * time.Millisecond)
	jids := h.stageMany(
		relay.Job{Name: "welcome", Args: []any{42, "ada@example.com"}, Queue: "mailers",
			Options: map[string]any{"attempts": 3, "backoff": 1000, "traceparent": traceparent}},
		relay.Job{Name: "report", Args: []any{"weekly"}, RunAt: runAt},
		relay.Job{Name: "urgent", Args: []any{7}, Options: map[string]any{"priority": 1}},
	)
	nodeJID := stageFromNode(t, h, false)
	if nodeJID == "" {
		t.Fatal("stage.js printed no jid")
	}

	type want struct {
		queue, name, data string
		check             func(r bullmqRun) string
	}
	wants := map[string]want{
		jids[0]: {"mailers", "welcome", `[42,"ada@example.com"]`, func(r bullmqRun) string {
			backoff, _ := json.Marshal(r.Opts["backoff"])
			tel, _ := r.Opts["telemetry"].(map[string]any)
			md, _ := tel["metadata"].(string)
			if r.Opts["attempts"] != 3.0 || string(backoff) != `{"delay":1000,"type":"fixed"}` || md != `{"traceparent":"`+traceparent+`"}` {
				return fmt.Sprintf("opts %v, want attempts 3, backoff fixed 1000, telemetry metadata with the traceparent", r.Opts)
			}
			return ""
		}},
		jids[1]: {"default", "report", `["weekly"]`, func(r bullmqRun) string {
			if r.ProcessedOn < runAt.UnixMilli() {
				return fmt.Sprintf("processed at %d ms, before its run_at %d ms", r.ProcessedOn, runAt.UnixMilli())
			}
			return ""
		}},
		jids[2]: {"default", "urgent", `[7]`, func(r bullmqRun) string {
			if r.Opts["priority"] != 1.0 {
				return fmt.Sprintf("opts %v, want priority 1", r.Opts)
			}
			return ""
		}},
		nodeJID: {"mailers", "welcome", `{"email":"ada@example.com"}`, func(r bullmqRun) string {
			if r.Opts["attempts"] != 3.0 {
				return fmt.Sprintf("opts %v, want attempts 3", r.Opts)
			}
			return ""
		}},
	}
	seen := make(map[string]int)
	deadline := time.After(20 * time.Second)
	for len(seen) < len(wants) {
		select {
		case r := <-runs:
			seen[r.ID]++
			w, ok := wants[r.ID]
			switch {
			case !ok:
				t.Errorf("the worker ran job %s (%s in %s, data %s), which was not staged and committed", r.ID, r.Name, r.Queue, r.Data)
			case seen[r.ID] > 1:
				t.Errorf("the worker ran job %s %d times", r.ID, seen[r.ID])
			default:
				var data bytes.Buffer
				_ = json.Compact(&data, r.Data)
				if r.Queue != w.queue || r.Name != w.name || data.String() != w.data {
					t.Errorf("job %s ran as %s in %s with data %s; staged as %s in %s with data %s", r.ID, r.Name, r.Queue, data.String(), w.name, w.queue, w.data)
				}
				if why := w.check(r); why != "" {
					t.Errorf("job %s (%s): %s", r.ID, r.Name, why)
				}
			}
		case <-deadline:
			t.Fatalf("within 20s the worker ran %v of the staged jobs %v; %d rows staged; logs: %v", seen, jids, h.staged(), messages(h.logs))
		}
	}

	// Every job completed once: BullMQ's completed sets hold them all and
	// nothing waits; the rolled-back job has no key.
	testenv.WaitFor(t, 15*time.Second, "every job completed", func() (bool, string) {
		var n int64
		for _, q := range []string{"mailers", "default"} {
			n += h.rdb.ZCard(ctx, h.ns+":"+q+":completed").Val()
		}
		return n == int64(len(wants)) && h.staged() == 0, fmt.Sprintf("%d completed, %d staged", n, h.staged())
	})
	if n := h.rdb.Exists(ctx, h.ns+":default:"+rolledBack).Val(); n != 0 {
		t.Errorf("the job staged in a rolled-back transaction has a BullMQ job key")
	}
	for len(runs) > 0 {
		r := <-runs
		t.Errorf("the worker ran job %s (%s) again, or a job never staged", r.ID, r.Name)
	}
}

// --max-queue-length counts a BullMQ queue's waiting jobs as BullMQ does:
// its wait list and prioritized set (and a paused list BullMQ 5 left).
// With a limit of 2, a prioritized job and a standard one fill the queue:
// the next jobs stay staged.
func TestBullMQMaxQueueLength(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	cfg.Target, cfg.MaxQueueLength = relay.TargetBullMQ, 2
	h.stageMany(
		relay.Job{Name: "a", Args: []any{1}, Options: map[string]any{"priority": 3}},
		relay.Job{Name: "b", Args: []any{2}},
		relay.Job{Name: "c", Args: []any{3}},
		relay.Job{Name: "d", Args: []any{4}},
	)
	h.start(cfg)
	h.waitLog("backpressure: pushes paused, jobs wait in PostgreSQL", 1)
	h.waitStaged(2)
	ctx := context.Background()
	wait, prio := h.rdb.LLen(ctx, h.ns+":default:wait").Val(), h.rdb.ZCard(ctx, h.ns+":default:prioritized").Val()
	if wait != 1 || prio != 1 || h.staged() != 2 {
		t.Fatalf("wait holds %d, prioritized %d, %d rows staged; want 1, 1 and 2", wait, prio, h.staged())
	}
}

// A job whose row BullMQ could not take is dead-lettered with the reason,
// and the others of its batch go.
func TestBullMQDeadLetters(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	cfg.Target = relay.TargetBullMQ
	ctx := context.Background()
	// A queue whose wait key holds a string: BullMQ's add would fail there.
	if err := h.rdb.Set(ctx, h.ns+":broken:wait", "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	h.stageMany(
		relay.Job{Name: "ok", Args: []any{1}},
		relay.Job{Name: "later", Args: []any{2}, Options: map[string]any{"delay": 5000}},
		relay.Job{Name: "broken", Args: []any{3}, Queue: "broken"},
	)
	h.start(cfg)
	h.waitStaged(0)
	rows, err := h.conn.Query(ctx, "SELECT job_name, reason FROM "+pgx.Identifier{h.schema, "staged_jobs_dead"}.Sanitize()+" ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ Name, Reason string }])
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0].Name != "later" || !strings.Contains(got[0].Reason, "run_at") ||
		got[1].Name != "broken" || !strings.HasPrefix(got[1].Reason, "WRONGTYPE "+h.ns+":broken:wait holds a string") {
		t.Fatalf("dead letters %+v; want later (delay: use run_at) and broken (WRONGTYPE on its wait key)", got)
	}
	if n := h.rdb.LLen(ctx, h.ns+":default:wait").Val(); n != 1 {
		t.Fatalf("default's wait list holds %d jobs, want 1", n)
	}
	if n := h.rdb.Exists(ctx, h.ns+":broken:id", h.ns+":broken:events").Val(); n != 0 {
		t.Fatalf("the refused job wrote %d of broken's id and events keys, want none: a job is added whole or not at all", n)
	}
}

// A second add of a job id BullMQ holds already is a no-op, as BullMQ's own
// add of an existing custom jobId is: the row is deleted, the job is left as
// it was, and BullMQ's job counter does not move.
func TestBullMQSameJIDIsANoOp(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	cfg.Target = relay.TargetBullMQ
	ctx := context.Background()
	insert := func(args string) {
		t.Helper()
		if _, err := h.conn.Exec(ctx, "INSERT INTO "+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()+
			" (job_name, job_args, jid) VALUES ('work', $1, 'job-1')", args); err != nil {
			t.Fatal(err)
		}
	}
	insert(`[1]`)
	h.start(cfg)
	h.waitStaged(0)
	insert(`[2]`)
	h.waitStaged(0)
	data := h.rdb.HGet(ctx, h.ns+":default:job-1", "data").Val()
	counter := h.rdb.Get(ctx, h.ns+":default:id").Val()
	waiting := h.rdb.LRange(ctx, h.ns+":default:wait", 0, -1).Val()
	if data != "[1]" || counter != "1" || len(waiting) != 1 || waiting[0] != "job-1" {
		t.Fatalf("job-1's data %q, the job counter %q, wait %v; want the first add's [1], 1 and [job-1]", data, counter, waiting)
	}
}

// A job of a queue whose meta says paused goes to its wait list with no
// marker, as BullMQ 6's add does (a worker wakes for it once the queue is
// resumed, which sets the marker); a queue's other jobs get the marker.
func TestBullMQPausedQueue(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	cfg.Target = relay.TargetBullMQ
	ctx := context.Background()
	if err := h.rdb.HSet(ctx, h.ns+":held:meta", "paused", 1).Err(); err != nil {
		t.Fatal(err)
	}
	jids := h.stageMany(relay.Job{Name: "a", Args: []any{1}, Queue: "held"}, relay.Job{Name: "b", Args: []any{2}, Queue: "open"})
	h.start(cfg)
	h.waitStaged(0)
	for i, q := range []string{"held", "open"} {
		wait := h.rdb.LRange(ctx, h.ns+":"+q+":wait", 0, -1).Val()
		marked := h.rdb.ZScore(ctx, h.ns+":"+q+":marker", "0").Err() == nil
		if len(wait) != 1 || wait[0] != jids[i] || marked != (q == "open") {
			t.Errorf("queue %s: wait %v, marker set %v; want [%s], and a marker only for the queue not paused", q, wait, marked, jids[i])
		}
	}
}
