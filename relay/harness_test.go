package relay_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// go-redis probes a server that refused PoolSize dials from a
		// goroutine of its own, which sees Close within a second and exits.
		goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"),
	)
}

// harness is one test's schema (migrated), Redis namespace and relay.
type harness struct {
	t      *testing.T
	schema string
	ns     string
	rdb    *redis.Client
	conn   *pgx.Conn
	stager *relay.Stager
	logs   *observer.ObservedLogs
}

func newHarness(t *testing.T) *harness {
	t.Helper()
	h := &harness{t: t, schema: testenv.Schema(t)}
	h.rdb, h.ns = testenv.Redis(t)
	h.conn = testenv.Conn(t, testenv.DatabaseURL())
	if _, err := relay.Migrate(context.Background(), h.conn, h.schema); err != nil {
		t.Fatalf("migrate: %v", err)
	}
	h.stager = relay.NewStager(h.schema)
	return h
}

// startSignaled runs a relay like start, and returns a channel that
// receives, each time its drain loop goes idle, how many LISTENs had
// completed before its last drain began.
func (h *harness) startSignaled(cfg relay.Config) (*relay.Relay, <-chan int64) {
	h.t.Helper()
	r, err := relay.New(cfg)
	if err != nil {
		h.t.Fatalf("relay.New: %v", err)
	}
	idle := idleEvents(r)
	h.run(r)
	return r, idle
}

// idleEvents makes r report each time its drain goes idle, with the
// listener's LISTEN count then (unread past 1,000, they are dropped).
// Before Run.
func idleEvents(r *relay.Relay) <-chan int64 {
	idle := make(chan int64, 1000)
	relay.SetOnIdle(r, func(listens int64) {
		select {
		case idle <- listens:
		default:
		}
	})
	return idle
}

// waitIdleAfterListen waits until the relay has gone idle after a drain
// that began once its listener was LISTENing: from then on, only a
// notification (or the poll) can wake it.
func (h *harness) waitIdleAfterListen(idle <-chan int64) {
	h.t.Helper()
	timeout := time.After(15 * time.Second)
	for {
		select {
		case n := <-idle:
			if n >= 1 {
				return
			}
		case <-timeout:
			h.t.Fatalf("the relay did not go idle after LISTENing within 15s; logs: %v", messages(h.logs))
		}
	}
}

// config is a relay config for this harness; change fields before start.
func (h *harness) config() relay.Config {
	core, logs := observer.New(zapcore.DebugLevel)
	h.logs = logs
	return relay.Config{
		DatabaseURL:    testenv.DatabaseURL(),
		Redis:          h.rdb,
		Schema:         h.schema,
		RedisNamespace: h.ns,
		MaxBackoff:     500 * time.Millisecond,
		Logger:         zap.New(core),
	}
}

// start runs a relay until the test ends, then checks that Run returned nil.
func (h *harness) start(cfg relay.Config) *relay.Relay {
	h.t.Helper()
	r, err := relay.New(cfg)
	if err != nil {
		h.t.Fatalf("relay.New: %v", err)
	}
	h.run(r)
	return r
}

func (h *harness) run(r *relay.Relay) {
	testenv.RunUntilCleanup(h.t, r.Run)
}

// waitLog waits until a log line with message msg has been written n times.
func (h *harness) waitLog(msg string, n int) {
	h.t.Helper()
	testenv.WaitFor(h.t, 15*time.Second, fmt.Sprintf("%d log line(s) %q", n, msg), func() (bool, string) {
		got := h.logs.FilterMessage(msg).Len()
		return got >= n, fmt.Sprintf("%d such lines; all: %v", got, messages(h.logs))
	})
}

func messages(logs *observer.ObservedLogs) []string {
	var out []string
	for _, e := range logs.All() {
		s := e.Message
		if err, ok := e.ContextMap()["error"]; ok {
			s += fmt.Sprintf(" (%v)", err)
		}
		out = append(out, s)
	}
	if len(out) > 30 {
		out = out[len(out)-30:]
	}
	return out
}

func (h *harness) key(k string) string { return h.ns + ":" + k }

// sidekiqJob is a pushed payload, decoded.
type sidekiqJob map[string]any

func (j sidekiqJob) jid() string { s, _ := j["jid"].(string); return s }

// queue returns the jobs in queue:<q> in the order workers take them
// (BRPOP pops from the right).
func (h *harness) queue(q string) []sidekiqJob {
	h.t.Helper()
	raw, err := h.rdb.LRange(context.Background(), h.key("queue:"+q), 0, -1).Result()
	if err != nil {
		h.t.Fatalf("LRANGE queue:%s: %v", q, err)
	}
	jobs := make([]sidekiqJob, 0, len(raw))
	for i := len(raw) - 1; i >= 0; i-- {
		jobs = append(jobs, decodeJob(h.t, raw[i]))
	}
	return jobs
}

// scheduled returns the schedule zset's jobs with their scores.
func (h *harness) scheduled() ([]sidekiqJob, []float64) {
	h.t.Helper()
	zs, err := h.rdb.ZRangeWithScores(context.Background(), h.key("schedule"), 0, -1).Result()
	if err != nil {
		h.t.Fatalf("ZRANGE schedule: %v", err)
	}
	var jobs []sidekiqJob
	var scores []float64
	for _, z := range zs {
		jobs = append(jobs, decodeJob(h.t, z.Member.(string)))
		scores = append(scores, z.Score)
	}
	return jobs, scores
}

func decodeJob(t *testing.T, s string) sidekiqJob {
	t.Helper()
	var j sidekiqJob
	if err := json.Unmarshal([]byte(s), &j); err != nil {
		t.Fatalf("payload is not JSON: %v: %s", err, s)
	}
	return j
}

// staged counts the rows left in staged_jobs.
func (h *harness) staged() int {
	h.t.Helper()
	var n int
	err := h.conn.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()).Scan(&n)
	if err != nil {
		h.t.Fatalf("count staged_jobs: %v", err)
	}
	return n
}

// stageMany commits jobs in one transaction and returns their jids.
func (h *harness) stageMany(jobs ...relay.Job) []string {
	h.t.Helper()
	var jids []string
	err := pgx.BeginFunc(context.Background(), h.conn, func(tx pgx.Tx) error {
		var err error
		jids, err = h.stager.StageMany(context.Background(), tx, jobs)
		return err
	})
	if err != nil {
		h.t.Fatalf("stage %d jobs: %v", len(jobs), err)
	}
	return jids
}

// queueJIDs returns the jids in queue:<q>, in the order workers take them.
func (h *harness) queueJIDs(q string) []string {
	h.t.Helper()
	var jids []string
	for _, j := range h.queue(q) {
		jids = append(jids, j.jid())
	}
	return jids
}

// waitStaged waits until staged_jobs holds n rows.
func (h *harness) waitStaged(n int) {
	h.t.Helper()
	testenv.WaitFor(h.t, 10*time.Second, fmt.Sprintf("%d rows in staged_jobs", n), func() (bool, string) {
		got := h.staged()
		return got == n, fmt.Sprintf("%d rows", got)
	})
}

// stage commits one job in its own transaction and returns its jid.
func (h *harness) stage(job relay.Job) string {
	h.t.Helper()
	var jid string
	err := pgx.BeginFunc(context.Background(), h.conn, func(tx pgx.Tx) error {
		var err error
		jid, err = h.stager.Stage(context.Background(), tx, job)
		return err
	})
	if err != nil {
		h.t.Fatalf("stage: %v", err)
	}
	return jid
}

// waitQueueLen waits until queue:<q> holds n jobs.
func (h *harness) waitQueueLen(q string, n int64, timeout time.Duration) {
	h.t.Helper()
	testenv.WaitFor(h.t, timeout, fmt.Sprintf("%d jobs in queue:%s", n, q), func() (bool, string) {
		got, err := h.rdb.LLen(context.Background(), h.key("queue:"+q)).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return false, err.Error()
		}
		return got == n, fmt.Sprintf("%d jobs, %d rows staged", got, h.staged())
	})
}

// handoffKeys returns the fence and record keys of h's schema.
func (h *harness) handoffKeys() (fence, record string) {
	return relay.HandoffKeys(h.ns, h.conn.Config().Database, h.schema)
}

// waitRecordEmpty waits until the handoff record holds no batch: every
// batch's delete committed and its record was deleted.
func (h *harness) waitRecordEmpty() {
	h.t.Helper()
	_, record := h.handoffKeys()
	testenv.WaitFor(h.t, 15*time.Second, "an empty handoff record", func() (bool, string) {
		m, err := h.rdb.HGetAll(context.Background(), record).Result()
		if err != nil {
			return false, err.Error()
		}
		return len(m) == 0, fmt.Sprintf("record %v", m)
	})
}
