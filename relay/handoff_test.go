package relay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A leader that pushed a batch and died before its delete committed leaves
// the rows staged; the next leader reads the handoff record, deletes those
// rows and does not push them again.
func TestNextLeaderDoesNotRepeatThePush(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	jids := h.stageMany(relay.Job{Name: "A"}, relay.Job{Name: "B"}, relay.Job{Name: "C", Queue: "other"},
		relay.Job{Name: "D", RunAt: time.Now().Add(time.Hour)})

	// The first leader dies between its push and its delete: its context
	// ends and the batch rolls back, as at a crash (the record stays).
	first, err := relay.New(h.config())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	relay.SetAfterPush(first, func(context.Context) error {
		cancel()
		return errors.New("injected crash after push")
	})
	done := make(chan error, 1)
	go func() { done <- first.Run(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("first relay: %v", err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("first relay did not stop")
	}
	if n := h.staged(); n != 4 {
		t.Fatalf("%d rows staged after the crash, want all 4", n)
	}
	pushed := func() []string {
		got := slices.Concat(h.queueJIDs("default"), h.queueJIDs("other"))
		sched, _ := h.scheduled()
		for _, j := range sched {
			got = append(got, j.jid())
		}
		slices.Sort(got)
		return got
	}
	want := slices.Sorted(slices.Values(jids))
	if got := pushed(); !slices.Equal(got, want) {
		t.Fatalf("the first relay pushed %v, want %v", got, want)
	}

	// The next leader.
	cfg := h.config()
	h.start(cfg)
	h.waitStaged(0)
	h.waitRecordEmpty()
	if got := pushed(); !slices.Equal(got, want) {
		t.Fatalf("after the next leader, Redis holds %v, want each of %v once", got, want)
	}
	lines := h.logs.FilterMessage("batch drained").All()
	if len(lines) == 0 || lines[0].ContextMap()["already_pushed"] != int64(4) {
		t.Fatalf("the next leader's batch: %v, want already_pushed 4", lines)
	}
	fence, _ := h.handoffKeys()
	if epoch, err := h.rdb.HGet(context.Background(), fence, "epoch").Int(); err != nil || epoch != 2 {
		t.Fatalf("fence epoch = %d, %v; want 2 (two leaderships)", epoch, err)
	}
}

// A relay whose fence token was replaced (another relay took the fence, as
// a new leader does while the old one is frozen or cut off) has its push
// refused whole: nothing of its batch reaches Redis, the rows stay staged,
// and it steps down. Here it then leads again (nobody else holds the lock),
// takes the fence anew and delivers each job once.
func TestFencedPushIsRefusedAndTheRelayStepsDown(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	fence, _ := h.handoffKeys()
	cfg := h.config()
	cfg.PollOnly = true // no NOTIFY: the poll drains
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	h.run(r)
	first := h.stage(relay.Job{Name: "First"})
	h.waitStaged(0)
	h.waitQueueLen("default", 1, 15*time.Second)

	// Another relay takes the fence.
	if err := h.rdb.HSet(ctx, fence, "token", "another-leader").Err(); err != nil {
		t.Fatal(err)
	}
	second := h.stage(relay.Job{Name: "Second"})
	h.waitLog("stepped down", 1)
	down := h.logs.FilterMessage("stepped down").All()[0]
	if msg := fmt.Sprint(down.ContextMap()["error"]); !strings.Contains(msg, "fenced off") {
		t.Fatalf("stepped down with %q, want the fence's refusal", msg)
	}
	h.waitStaged(0)
	if got := h.queueJIDs("default"); !slices.Equal(got, []string{first, second}) {
		t.Fatalf("delivered %v, want %v, each once", got, []string{first, second})
	}
	if n := h.logs.FilterMessage("became leader").Len(); n < 2 {
		t.Fatalf("became leader %d times, want again after stepping down", n)
	}
	if epoch, err := h.rdb.HGet(ctx, fence, "epoch").Int(); err != nil || epoch != 2 {
		t.Fatalf("fence epoch = %d, %v; want 2", epoch, err)
	}
}

// The handoff record holds the batches in flight, not every batch ever
// pushed: after 100,000 jobs the namespace holds Sidekiq's keys and the
// fence, and no record.
func TestHandoffRecordStaysBoundedOverManyJobs(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	ctx := context.Background()
	cfg := h.config()
	core, logs := observer.New(zapcore.InfoLevel) // not a debug line per batch
	h.logs = logs
	cfg.Logger = zap.New(core)
	cfg.BatchSize = 1000
	h.start(cfg)
	const n = 100_000
	conn := testenv.Conn(t, testenv.DatabaseURL())
	table := fmt.Sprintf("%q.staged_jobs", h.schema)
	for i := 0; i < n; i += 10_000 {
		if _, err := conn.Exec(ctx, `INSERT INTO `+table+` (job_name, job_args, queue)
			SELECT 'ManyJob', jsonb_build_array(g), 'q' || (g % 3) FROM generate_series($1::int, $1::int + 9999) g`, i); err != nil {
			t.Fatal(err)
		}
	}
	testenv.WaitFor(t, 120*time.Second, "100,000 jobs drained", func() (bool, string) {
		s := h.staged()
		return s == 0, fmt.Sprintf("%d staged", s)
	})
	h.waitRecordEmpty()
	var total int64
	for q := range 3 {
		l, err := h.rdb.LLen(ctx, h.key(fmt.Sprintf("queue:q%d", q))).Result()
		if err != nil {
			t.Fatal(err)
		}
		total += l
	}
	if total != n {
		t.Fatalf("%d jobs in Redis, want %d", total, n)
	}
	keys, err := h.rdb.Keys(ctx, h.ns+":*").Result()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(keys)
	fence, _ := h.handoffKeys()
	want := []string{h.key("queue:q0"), h.key("queue:q1"), h.key("queue:q2"), h.key("queues"), fence}
	slices.Sort(want)
	if !slices.Equal(keys, want) {
		t.Fatalf("keys after %d jobs: %v, want %v: the record is deleted as batches commit", n, keys, want)
	}
}
