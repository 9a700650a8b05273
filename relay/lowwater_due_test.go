package relay_test

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A target with no scheduler (streams) claims from the low-water mark too:
// a claim leaves a scheduled row staged and the mark passes it, and once
// its run_at is due the look after a drain finds it below the mark and it
// is added, at its time. The probe is off and the poll a minute away: only
// the look can find it. Also for a relay with --queues, whose look is of
// its group's queues.
func TestStreamsDueRowBelowTheMarkIsAdded(t *testing.T) {
	t.Parallel()
	for _, queues := range [][]string{nil, {"default"}} {
		t.Run(fmt.Sprintf("queues=%v", queues), func(t *testing.T) {
			t.Parallel()
			testStreamsDueRowBelowTheMark(t, queues)
		})
	}
}

func testStreamsDueRowBelowTheMark(t *testing.T, queues []string) {
	ctx := context.Background()
	h := newHarness(t)
	cfg := h.config()
	cfg.Target = relay.TargetStreams
	cfg.PollInterval = time.Minute
	cfg.Queues = queues
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.SetProbeEvery(r, time.Hour)
	h.run(r)
	// Far enough ahead that the mark passes it (waitMark: 15s at most)
	// while it is still staged.
	runAt := time.Now().Add(20 * time.Second)
	h.stage(relay.Job{Name: "Later", RunAt: runAt})
	laterID := h.maxStagedID()
	for range 5 {
		h.stage(relay.Job{Name: "Now"})
	}
	stream := h.key("stream:default")
	testenv.WaitFor(t, 15*time.Second, "the five immediate jobs added", func() (bool, string) {
		n, _ := h.rdb.XLen(ctx, stream).Result()
		return n == 5, fmt.Sprintf("%d entries", n)
	})
	waitMark(t, r, laterID)
	if n := h.staged(); n != 1 {
		t.Fatalf("%d rows staged once the mark passed the scheduled one, want it alone", n)
	}
	// The backlog, counted from the mark, still counts it.
	sql, args, fromMark := relay.BacklogQuery(r)
	var backlog int
	var oldest *time.Time
	if err := h.conn.QueryRow(ctx, sql, args...).Scan(&backlog, &oldest); err != nil {
		t.Fatal(err)
	}
	if !fromMark || backlog != 1 {
		t.Errorf("the backlog sample counts %d rows (from the mark: %v), want the scheduled one", backlog, fromMark)
	}
	testenv.WaitFor(t, time.Until(runAt)+15*time.Second, "the scheduled job added", func() (bool, string) {
		n, _ := h.rdb.XLen(ctx, stream).Result()
		return n == 6, fmt.Sprintf("%d entries", n)
	})
	last, err := h.rdb.XRevRangeN(ctx, stream, "+", "-", 1).Result()
	if err != nil || len(last) != 1 || last[0].Values["class"] != "Later" {
		t.Fatalf("last entry %v (%v), want the scheduled job", last, err)
	}
	ms, _, _ := strings.Cut(last[0].ID, "-")
	if added, err := strconv.ParseInt(ms, 10, 64); err != nil || added < runAt.UnixMilli() {
		t.Errorf("scheduled job added at %s ms, before its run_at %d", ms, runAt.UnixMilli())
	}
	h.waitStaged(0)
}

// A fleet's schema with the streams target: its drain loop looks below its
// own mark after each drain, as a relay of one schema does.
func TestFleetStreamsDueRowBelowTheMarkIsAdded(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fh := newFleetHarness(t, 2)
	cfg := fh.fleetConfig()
	cfg.Target = relay.TargetStreams
	cfg.PollInterval = time.Minute
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.SetProbeEvery(r, time.Hour)
	fh.run(r)
	testenv.WaitFor(t, 15*time.Second, "the relay leads both schemas", func() (bool, string) {
		got := leads(r)
		return len(got) == 2, fmt.Sprintf("leads %q", got)
	})
	schema := fh.schemas[0]
	runAt := time.Now().Add(20 * time.Second)
	if _, err := relay.NewStager(schema).Stage(ctx, fh.conn, relay.Job{Name: "Later", RunAt: runAt}); err != nil {
		t.Fatal(err)
	}
	var laterID int64
	if err := fh.conn.QueryRow(ctx, `SELECT max(id) FROM `+pgx.Identifier{schema, "staged_jobs"}.Sanitize()).Scan(&laterID); err != nil {
		t.Fatal(err)
	}
	for range 5 {
		fh.stageIn(schema, "default")
	}
	stream := fh.key("stream:default")
	testenv.WaitFor(t, 15*time.Second, "the five immediate jobs added", func() (bool, string) {
		n, _ := fh.rdb.XLen(ctx, stream).Result()
		return n == 5, fmt.Sprintf("%d entries", n)
	})
	waitMark(t, relay.FleetTenant(r, schema), laterID)
	testenv.WaitFor(t, time.Until(runAt)+15*time.Second, "the scheduled job added", func() (bool, string) {
		n, _ := fh.rdb.XLen(ctx, stream).Result()
		return n == 6, fmt.Sprintf("%d entries", n)
	})
}

// With the horizon held, a streams relay's claim from the mark and the
// statement it runs after each drain (the next run_at, and the look for
// rows below the mark that came due) cost the same after 2,000 and after
// 22,000 dead rows: the look and the next run_at read 013's index of the
// scheduled rows' run_at, where a scan of the table read every dead row.
func TestStreamsClaimCostDoesNotGrowWithDeadRows(t *testing.T) {
	h, pg := privateHarness(t, "autovacuum=off")
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	cfg.Target = relay.TargetStreams
	r := h.start(cfg)
	h.stage(relay.Job{Name: "Later", RunAt: time.Now().Add(time.Hour)}) // for the next run_at to find
	holdHorizon(t, pg.URL())

	ctx := context.Background()
	var total int64
	var backlog []int64 // the summary's backlog sample's buffers, per phase
	phase := func(n int) (claim, look, fromStart int64) {
		t.Helper()
		h.stageRows(n)
		total += int64(n)
		testenv.WaitFor(t, 60*time.Second, fmt.Sprintf("%d entries", total), func() (bool, string) {
			got, _ := h.rdb.XLen(ctx, h.key("stream:default")).Result()
			return got == total, fmt.Sprintf("%d entries", got)
		})
		h.waitStaged(1)
		top := h.maxStagedID()
		waitMark(t, r, top)
		from, _ := relay.LowWater(r)
		backlog = append(backlog, h.backlogBuffers(r))
		since := time.Now().Add(-time.Minute)
		return h.claimBuffers(r, from), h.drainBuffers(relay.NextDueLookSQL(r), from, since),
			h.claimBuffers(r, math.MinInt64)
	}
	earlyClaim, earlyLook, earlyStart := phase(2000)
	lateClaim, lateLook, lateStart := phase(20000)
	t.Logf("claim buffers from the mark %d -> %d, from the index's start %d -> %d; next run_at and look %d -> %d; backlog sample %d -> %d",
		earlyClaim, lateClaim, earlyStart, lateStart, earlyLook, lateLook, backlog[0], backlog[1])
	costFlat(t, "the backlog sample", backlog[0], backlog[1])
	horizonHeld(t, earlyStart, lateStart)
	costFlat(t, "the relay's claim", earlyClaim, lateClaim)
	costFlat(t, "the next run_at and the look below the mark", earlyLook, lateLook)
	if n := h.logs.FilterMessage("could not read the next run_at; the poll wakes for it").Len(); n != 0 {
		t.Errorf("the next run_at could not be read %d times: %v", n, messages(h.logs))
	}
}
