package relay_test

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A consumer group reads each job as an entry of stream:<queue> (under the
// namespace) with the fields jid, class, args, queue, created_at (epoch ms)
// and, when set, options. A job whose run_at is in the future stays staged
// and is added once due: the relay wakes for it, long before its next poll.
func TestStreamsTarget(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	cfg := h.config()
	cfg.Target = relay.TargetStreams
	cfg.PollInterval = time.Minute // only the wake for run_at can deliver the scheduled job in time
	stream := h.key("stream:events")
	if err := h.rdb.XGroupCreateMkStream(ctx, stream, "workers", "0").Err(); err != nil {
		t.Fatal(err)
	}
	h.start(cfg)
	read := func(block time.Duration) []redis.XMessage {
		t.Helper()
		res, err := h.rdb.XReadGroup(ctx, &redis.XReadGroupArgs{Group: "workers", Consumer: "c1",
			Streams: []string{stream, ">"}, Count: 10, Block: block}).Result()
		if err != nil {
			t.Fatalf("XREADGROUP: %v; logs: %v", err, messages(h.logs))
		}
		return res[0].Messages
	}

	before := time.Now().Truncate(time.Millisecond)
	runAt := time.Now().Add(2 * time.Second)
	jids := h.stageMany(
		relay.Job{Name: "UserSignedUp", Args: []any{42, "ada"}, Queue: "events", Options: map[string]any{"tags": []string{"a"}}},
		relay.Job{Name: "TrialEnds", Args: []any{42}, Queue: "events", RunAt: runAt},
	)
	after := time.Now()

	got := read(10 * time.Second)
	if len(got) != 1 {
		t.Fatalf("first read: %d entries %v, want the immediate job only", len(got), got)
	}
	e := got[0].Values
	if e["jid"] != jids[0] || e["class"] != "UserSignedUp" || e["args"] != `[42, "ada"]` ||
		e["queue"] != "events" || e["options"] != `{"tags": ["a"]}` || len(e) != 6 {
		t.Errorf("entry %v, want jid %s, class UserSignedUp, args [42, \"ada\"], queue events, options {\"tags\": [\"a\"]}", e, jids[0])
	}
	created, err := strconv.ParseInt(fmt.Sprint(e["created_at"]), 10, 64)
	if err != nil || created < before.UnixMilli() || created > after.UnixMilli() {
		t.Errorf("created_at %v, want epoch ms between %d and %d", e["created_at"], before.UnixMilli(), after.UnixMilli())
	}
	// The immediate job's delete commits after its XADD; the scheduled
	// job's row stays until its run_at.
	if wait := time.Until(runAt); wait > 0 {
		testenv.WaitFor(t, wait, "the scheduled job's row alone staged before its run_at", func() (bool, string) {
			n := h.staged()
			return n == 1, fmt.Sprintf("%d rows", n)
		})
	}

	got = read(10 * time.Second)
	arrived := time.Now()
	if len(got) != 1 || got[0].Values["jid"] != jids[1] || got[0].Values["class"] != "TrialEnds" {
		t.Fatalf("second read: %v, want the scheduled job", got)
	}
	ms, _, _ := strings.Cut(got[0].ID, "-")
	if added, err := strconv.ParseInt(ms, 10, 64); err != nil || added < runAt.UnixMilli() {
		t.Errorf("scheduled job added at %s (stream id %s), before its run_at %d", ms, got[0].ID, runAt.UnixMilli())
	}
	if arrived.Sub(runAt) > 5*time.Second {
		t.Errorf("scheduled job arrived %s after its run_at: the relay did not wake for it", arrived.Sub(runAt))
	}
	if _, ok := got[0].Values["options"]; ok {
		t.Errorf("entry %v has options, though the row's were {}", got[0].Values)
	}
	h.waitStaged(0)
}

// --stream-maxlen trims each stream to about that many entries as it
// writes (MAXLEN ~: whole nodes of 100 entries at a time).
func TestStreamsMaxLen(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	cfg.Target, cfg.StreamMaxLen = relay.TargetStreams, 10
	jobs := make([]relay.Job, 500)
	for i := range jobs {
		jobs[i] = relay.Job{Name: "Tick", Args: []any{i}}
	}
	h.stageMany(jobs...)
	h.start(cfg)
	h.waitStaged(0)
	n, err := h.rdb.XLen(context.Background(), h.key("stream:default")).Result()
	if err != nil || n < 10 || n > 200 {
		t.Fatalf("XLEN after 500 entries with MAXLEN ~ 10: %d (%v), want 10 to 200", n, err)
	}
	last, err := h.rdb.XRevRangeN(context.Background(), h.key("stream:default"), "+", "-", 1).Result()
	if err != nil || len(last) != 1 || last[0].Values["args"] != "[499]" {
		t.Fatalf("last entry %v (%v), want args [499]", last, err)
	}
}

// The claim of the streams target leaves future rows staged: a relay with
// only future jobs staged drains nothing, and wakes for the earliest.
func TestStreamsLeavesFutureRowsStaged(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	cfg := h.config()
	cfg.Target = relay.TargetStreams
	h.stageMany(relay.Job{Name: "Later", RunAt: time.Now().Add(time.Hour)}, relay.Job{Name: "Now"})
	_, idle := h.startSignaled(cfg)
	h.waitIdleAfterListen(idle)
	if n := h.staged(); n != 1 {
		t.Fatalf("%d rows staged, want the future one", n)
	}
	n, err := h.rdb.XLen(context.Background(), h.key("stream:default")).Result()
	if err != nil && !errors.Is(err, redis.Nil) || n != 1 {
		t.Fatalf("XLEN %d (%v), want the immediate job only", n, err)
	}
	if n := h.logs.FilterMessage("could not read the next run_at; the poll wakes for it").Len(); n != 0 {
		t.Errorf("the next run_at could not be read %d times: %v", n, messages(h.logs))
	}
}
