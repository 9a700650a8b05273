package relay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// maxStagedID is the highest id staged_jobs has handed out.
func (h *harness) maxStagedID() int64 { return h.lastValue("staged_jobs_id_seq") }

// lastValue is the last value the sequence seq of h's schema handed out.
func (h *harness) lastValue(seq string) int64 {
	h.t.Helper()
	var id int64
	if err := h.conn.QueryRow(context.Background(), `SELECT last_value FROM `+
		pgx.Identifier{h.schema, seq}.Sanitize()).Scan(&id); err != nil {
		h.t.Fatal(err)
	}
	return id
}

// firstJobToMark stages a first job, waits for it in Redis and for the
// relay's low-water mark to reach it, and returns its id.
func (h *harness) firstJobToMark(r *relay.Relay) int64 {
	h.t.Helper()
	h.stage(relay.Job{Name: "First"})
	h.waitQueueLen("default", 1, 15*time.Second)
	id := h.maxStagedID()
	waitMark(h.t, r, id)
	return id
}

// waitMark waits until the relay's low-water mark is at least id.
func waitMark(t *testing.T, r *relay.Relay, id int64) {
	t.Helper()
	// A claim confirms the mark once its snapshot's xmin has passed the
	// id's transaction: the oldest transaction id still running in the
	// whole cluster, so any other test's open writing transaction holds
	// it. On a busy machine, with the suite's tests in parallel, such
	// transactions last long enough that 15s was not always enough.
	testenv.WaitFor(t, time.Minute, fmt.Sprintf("the low-water mark at %d or above", id), func() (bool, string) {
		l, on := relay.LowWater(r)
		return on && l >= id, fmt.Sprintf("mark %d (on: %v)", l, on)
	})
}

// claimBuffers is the shared buffers (hit and read) the relay's claim
// statement touches, claiming above from (of queues, for a relay with
// Config.Queues), by EXPLAIN (ANALYZE, BUFFERS), rolled back.
func (h *harness) claimBuffers(r *relay.Relay, from int64, queues ...string) int64 {
	h.t.Helper()
	args := []any{100, []int64{}, from}
	if len(queues) > 0 {
		args = append(args, queues)
	}
	return h.drainBuffers(relay.ClaimMarkSQL(r), append(args, []string{})...)
}

// drainBuffers returns the shared buffers sql touches with args, planned as
// the drain's sessions plan it (no sequential scans, no JIT, a generic
// plan), in a transaction rolled back.
func (h *harness) drainBuffers(sql string, args ...any) int64 {
	h.t.Helper()
	ctx := context.Background()
	tx, err := h.conn.Begin(ctx)
	if err != nil {
		h.t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SET LOCAL enable_seqscan = off; SET LOCAL jit = off; SET LOCAL plan_cache_mode = force_generic_plan`); err != nil {
		h.t.Fatal(err)
	}
	return h.buffers(tx, sql, args...)
}

// drainedToMark waits until total jobs are in queue and staged rows are
// left in the table, the relay r's low-water mark has reached the last id
// handed out, and r's last claim from the mark started there; it returns
// where that claim started.
func (h *harness) drainedToMark(r *relay.Relay, queue string, total int64, staged int) int64 {
	h.t.Helper()
	h.waitQueueLen(queue, total, 60*time.Second)
	h.waitStaged(staged)
	top := h.maxStagedID()
	waitMark(h.t, r, top)
	// The claim that moved the mark started below it, and no claim need
	// come after it: a notification wakes one (a fleet's shared drain, or
	// the schema's own drain, claims from the mark too).
	testenv.WaitFor(h.t, 15*time.Second, "a claim from the mark at the last id", func() (bool, string) {
		from := relay.LastClaimFrom(r)
		if from < top {
			if _, err := h.conn.Exec(context.Background(), `SELECT pg_notify($1, 'claim')`, relay.ChannelName(h.schema)); err != nil {
				h.t.Fatal(err)
			}
		}
		return from >= top, fmt.Sprintf("last claim from %d, last id %d", from, top)
	})
	return relay.LastClaimFrom(r)
}

// costFlat fails the test when what touched more buffers after 22,000 dead
// rows (late) than 1.5 times, and 3 more than, after 2,000 (early).
func costFlat(t *testing.T, what string, early, late int64) {
	t.Helper()
	if late > max(early*3/2, early+3) {
		t.Fatalf("%s touched %d buffers after 22,000 dead rows, %d after 2,000: its cost grows with the dead rows", what, late, early)
	}
}

// horizonHeld fails the test when a claim from the index's start did not
// touch at least 5 times the buffers after 22,000 dead rows (late) as after
// 2,000 (early): the dead rows were not there to step over.
func horizonHeld(t *testing.T, early, late int64) {
	t.Helper()
	if late < 5*early {
		t.Fatalf("a claim from the index's start touched %d buffers after 22,000 dead rows, %d after 2,000: the horizon was not held", late, early)
	}
}

// buffers returns the shared buffers sql touched, run in tx with args.
func (h *harness) buffers(tx pgx.Tx, sql string, args ...any) int64 {
	h.t.Helper()
	var plan []byte
	if err := tx.QueryRow(context.Background(), `EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) `+sql, args...).Scan(&plan); err != nil {
		h.t.Fatal(err)
	}
	var out []struct {
		Plan struct {
			Hit  int64 `json:"Shared Hit Blocks"`
			Read int64 `json:"Shared Read Blocks"`
		}
	}
	if err := json.Unmarshal(plan, &out); err != nil || len(out) != 1 {
		h.t.Fatalf("EXPLAIN output %s: %v", plan, err)
	}
	return out[0].Plan.Hit + out[0].Plan.Read
}

// backlogBuffers returns the shared buffers the relay's next backlog sample
// touches.
func (h *harness) backlogBuffers(r *relay.Relay) int64 {
	h.t.Helper()
	ctx := context.Background()
	tx, err := h.conn.Begin(ctx)
	if err != nil {
		h.t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	sql, args, indexOnly := relay.BacklogQuery(r)
	if indexOnly {
		if _, err := tx.Exec(ctx, `SET LOCAL enable_seqscan = off; SET LOCAL jit = off`); err != nil {
			h.t.Fatal(err)
		}
	}
	return h.buffers(tx, sql, args...)
}

// With the xmin horizon held (pg_dump's snapshot), the rows the relay
// deletes stay in the id index. A claim from the index's start walks them
// all, so its cost grows with them; the relay's claims start at the
// low-water mark, and cost the same after 2,000 and after 22,000 dead
// rows. Buffers are counted, not milliseconds. A read-only snapshot holder
// does not hold the mark back: it reaches the last id drained.
func TestClaimCostDoesNotGrowWithDeadRows(t *testing.T) {
	h, pg := privateHarness(t, "autovacuum=off")
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	r := h.start(cfg)
	holdHorizon(t, pg.URL())

	var total int64
	var backlog []int64 // the summary's backlog sample's buffers, per phase
	phase := func(n int) (fromMark, fromIndexStart int64) {
		t.Helper()
		h.stageRows(n)
		total += int64(n)
		from := h.drainedToMark(r, "default", total, 0)
		backlog = append(backlog, h.backlogBuffers(r))
		return h.claimBuffers(r, from), h.claimBuffers(r, math.MinInt64)
	}
	earlyMark, earlyStart := phase(2000)
	// The probe from the index's start over the first 2,000 dead rows.
	earlyProbe := h.drainBuffers(relay.ProbeSQL(r), relay.LastClaimFrom(r), int64(math.MinInt64))
	lateMark, lateStart := phase(20000)
	// 2,000 more: the probe that follows looks above the last probe's mark
	// only, over the rows drained since, whatever lies dead below it.
	probedTo := relay.LastClaimFrom(r)
	phase(2000)
	lateProbe := h.drainBuffers(relay.ProbeSQL(r), relay.LastClaimFrom(r), probedTo)
	fullProbe := h.drainBuffers(relay.ProbeSQL(r), relay.LastClaimFrom(r), int64(math.MinInt64))
	t.Logf("claim buffers: from the mark %d -> %d, from the index's start %d -> %d; backlog sample %d -> %d; probe of the last 2,000 drained %d -> %d (from the index's start %d)",
		earlyMark, lateMark, earlyStart, lateStart, backlog[0], backlog[1], earlyProbe, lateProbe, fullProbe)
	// The summary's sample runs on the lock connection, which the gate
	// waits for: from the index's start it walked every dead row.
	costFlat(t, "the backlog sample", backlog[0], backlog[1])
	horizonHeld(t, earlyStart, lateStart)
	costFlat(t, "the relay's claim", earlyMark, lateMark)
	costFlat(t, "the probe above the last probe's mark", earlyProbe, lateProbe)
	horizonHeld(t, earlyProbe, fullProbe)
}

// The probe looks from the index's start every probeEvery while that is
// cheap, and at most 1% of the time when it is not; the others look above
// the last probe's mark only.
func TestFullProbeSpacing(t *testing.T) {
	start := time.Date(2026, 12, 3, 0, 0, 0, 0, time.UTC)
	every := 5 * time.Second
	for _, c := range []struct {
		since, took time.Duration
		want        bool
	}{
		{since: 5 * time.Second, took: 2 * time.Millisecond, want: true},
		{since: 4 * time.Second, took: 2 * time.Millisecond, want: false},
		{since: 5 * time.Second, took: 256 * time.Millisecond, want: false},
		{since: 25 * time.Second, took: 256 * time.Millisecond, want: false},
		{since: 26 * time.Second, took: 256 * time.Millisecond, want: true},
	} {
		if got := relay.FullProbeDue(start, c.took, every, start.Add(c.since)); got != c.want {
			t.Errorf("%s after a probe from the index's start that took %s: due %v, want %v", c.since, c.took, got, c.want)
		}
	}
	if !relay.FullProbeDue(time.Time{}, 0, every, start) {
		t.Error("the first probe of a leadership does not look from the index's start")
	}
}

// A row whose transaction took its id (011's default) and committed only
// after higher ids were drained is still drained: the mark stays below it
// while that transaction is open, with no help from the probe.
func TestLateLowIDIsDrainedAboveTheMark(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	r, err := relay.New(h.config())
	if err != nil {
		t.Fatal(err)
	}
	relay.SetProbeEvery(r, time.Hour) // not while the test runs
	idle := idleEvents(r)
	h.run(r)
	h.firstJobToMark(r)

	ctx := context.Background()
	late := testenv.Conn(t, testenv.DatabaseURL())
	tx, err := late.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var lateID int64
	if err := tx.QueryRow(ctx, `INSERT INTO `+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()+
		` (job_name, job_args) VALUES ('Late', '[]') RETURNING id`).Scan(&lateID); err != nil {
		t.Fatal(err)
	}
	for range 20 {
		h.stage(relay.Job{Name: "Later"})
	}
	h.waitQueueLen("default", 21, 15*time.Second)
	h.waitIdleAfterListen(idle)
	// Drained and idle: every claim since could have moved the mark.
	if l, _ := relay.LowWater(r); l >= lateID {
		t.Fatalf("low-water mark %d passed id %d, whose transaction is still open", l, lateID)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h.waitQueueLen("default", 22, 15*time.Second)
	// Its transaction ended: the mark passes it. (It need not reach the
	// last id: a claim confirms the mark only once every transaction older
	// than the last batch's has ended, and the shared server has others.)
	waitMark(t, r, lateID)
}

// A row below the mark that no default id put there (an id the app set
// itself) is found by the probe, which lowers the mark, and is drained.
func TestProbeFindsARowBelowTheMark(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	r, err := relay.New(h.config())
	if err != nil {
		t.Fatal(err)
	}
	relay.SetProbeEvery(r, 100*time.Millisecond)
	found := make(chan int64, 100)
	relay.SetOnProbeFound(r, func(id int64) { found <- id })
	h.run(r)
	for range 5 {
		h.stage(relay.Job{Name: "Default"})
	}
	h.waitQueueLen("default", 5, 15*time.Second)
	waitMark(t, r, h.maxStagedID())

	if _, err := h.conn.Exec(context.Background(), `INSERT INTO `+pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()+
		` (id, job_name, job_args) VALUES (0, 'Explicit', '[]')`); err != nil {
		t.Fatal(err)
	}
	select {
	case id := <-found:
		if id != 0 {
			t.Fatalf("the probe found id %d, want 0", id)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("the probe did not find the row with id 0 below the mark within 15s")
	}
	h.waitQueueLen("default", 6, 15*time.Second)
	h.waitStaged(0)
}

// A fleet's schema has a low-water mark of its own: with the horizon held,
// its claims, and the fleet's poll that finds which schemas hold rows,
// cost the same after 2,000 and after 22,000 dead rows.
func TestFleetClaimCostDoesNotGrowWithDeadRows(t *testing.T) {
	pg := testenv.StartPostgres(t, "autovacuum=off")
	h := &harness{t: t, schema: "tenant_a"}
	h.rdb, h.ns = testenv.Redis(t)
	h.conn = testenv.Conn(t, pg.URL())
	for _, s := range []string{"tenant_a", "tenant_b"} {
		if _, err := relay.Migrate(context.Background(), h.conn, s); err != nil {
			t.Fatal(err)
		}
	}
	h.stager = relay.NewStager(h.schema)
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	cfg.Schema, cfg.Schemas = "", []string{"tenant_*"}
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Each drain claims from its mark after its last short batch; a fleet
	// that ran hot leaves the schemas to its poll, and cools without a
	// claim (coolDown): no claim from the mark would come.
	relay.SetFleetHotEnter(r, math.Inf(1))
	h.run(r)
	testenv.WaitFor(t, 15*time.Second, "the relay leads both schemas", func() (bool, string) {
		got := leads(r)
		return len(got) == 2, fmt.Sprintf("leads %q", got)
	})
	holdHorizon(t, pg.URL())
	tenant := relay.FleetTenant(r, h.schema)

	var total int64
	phase := func(n int) (fromMark, fromIndexStart, poll int64) {
		t.Helper()
		h.stageRows(n)
		total += int64(n)
		from := h.drainedToMark(tenant, "default", total, 0)
		sql, args := relay.FleetPollQuery(r)
		return h.claimBuffers(tenant, from), h.claimBuffers(tenant, math.MinInt64), h.drainBuffers(sql, args...)
	}
	earlyMark, earlyStart, earlyPoll := phase(2000)
	lateMark, lateStart, latePoll := phase(20000)
	t.Logf("claim buffers: from the mark %d -> %d, from the index's start %d -> %d; the fleet's poll %d -> %d", earlyMark, lateMark, earlyStart, lateStart, earlyPoll, latePoll)
	horizonHeld(t, earlyStart, lateStart)
	costFlat(t, "the schema's claim", earlyMark, lateMark)
	costFlat(t, "the fleet's poll", earlyPoll, latePoll)
}

// A relay with Config.Queues has a low-water mark of its group's rows: with
// the horizon held its claims cost the same after 2,000 and 22,000 dead
// rows, though another group's row sits staged below the mark all along;
// its probe looks for its own queues' rows only (the other group's row,
// below the mark, is never "found"), and finds one of them put below the
// mark by hand.
func TestQueuesClaimCostDoesNotGrowWithDeadRows(t *testing.T) {
	h, pg := privateHarness(t, "autovacuum=off")
	ctx := context.Background()
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	var other int64
	if err := h.conn.QueryRow(ctx, `INSERT INTO `+table+` (job_name, job_args, queue) VALUES ('Other', '[]', 'b') RETURNING id`).Scan(&other); err != nil {
		t.Fatal(err)
	}
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	cfg.Queues = []string{"a"}
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.SetProbeEvery(r, 50*time.Millisecond)
	found := make(chan int64, 1000)
	relay.SetOnProbeFound(r, func(id int64) { found <- id })
	h.run(r)
	holdHorizon(t, pg.URL())

	var total int64
	phase := func(n int) (fromMark, fromIndexStart int64) {
		t.Helper()
		for left := n; left > 0; left -= 100 {
			if _, err := h.conn.Exec(ctx, `INSERT INTO `+table+` (job_name, job_args, queue)
				SELECT 'Job', '[]', 'a' FROM generate_series(1, $1)`, min(left, 100)); err != nil {
				t.Fatal(err)
			}
		}
		total += int64(n)
		from := h.drainedToMark(r, "a", total, 1) // the other group's row stays
		return h.claimBuffers(r, from, "a"), h.claimBuffers(r, math.MinInt64, "a")
	}
	earlyMark, earlyStart := phase(2000)
	lateMark, lateStart := phase(20000)
	t.Logf("claim buffers: from the mark %d -> %d, from the index's start %d -> %d", earlyMark, lateMark, earlyStart, lateStart)
	horizonHeld(t, earlyStart, lateStart)
	costFlat(t, "the group's claim", earlyMark, lateMark)

	if _, err := h.conn.Exec(ctx, `INSERT INTO `+table+` (id, job_name, job_args, queue) VALUES (-1, 'Explicit', '[]', 'a')`); err != nil {
		t.Fatal(err)
	}
	h.waitQueueLen("a", total+1, 15*time.Second)
	for {
		select {
		case id := <-found:
			if id == other {
				t.Fatalf("the probe found row %d of the other group's queue", other)
			}
			continue
		default:
		}
		break
	}
	h.waitStaged(1)
}

// An empty claim makes a candidate too (the next transaction id, read
// after S, stands for the id it did not take; lowwater.go): rows
// that were staged and deleted before the relay claimed them (as a fleet's
// shared drain deletes them, or an app that took its job back in its own
// transaction) carry the mark past them once the claims that find nothing
// go on. Before, an empty claim made none, and the mark stayed below the
// last rows of a shared drain for good (TestFleetClaimCostDoesNotGrowWithDeadRows
// failed so on a busy machine).
func TestEmptyClaimsCarryTheMark(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	r, err := relay.New(h.config())
	if err != nil {
		t.Fatal(err)
	}
	relay.SetProbeEvery(r, time.Hour) // not while the test runs
	h.run(r)
	first := h.firstJobToMark(r)

	ctx := context.Background()
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	tx, err := h.conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO `+table+` (job_name, job_args) SELECT 'Gone', '[]' FROM generate_series(1, 5)`); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `DELETE FROM `+table+` WHERE job_name = 'Gone'`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	last := h.maxStagedID()
	if last != first+5 {
		t.Fatalf("the sequence is at %d, want %d", last, first+5)
	}
	// Each notification wakes the relay to a claim that finds nothing;
	// a claim confirms an earlier one's candidate once every transaction
	// older than it has ended (the shared server has others).
	testenv.WaitFor(t, 15*time.Second, fmt.Sprintf("the low-water mark at %d", last), func() (bool, string) {
		if _, err := h.conn.Exec(ctx, `SELECT pg_notify($1, 'poke')`, relay.ChannelName(h.schema)); err != nil {
			t.Fatal(err)
		}
		l, _ := relay.LowWater(r)
		return l >= last, fmt.Sprintf("mark %d", l)
	})
	if n := h.queueLenNow("default"); n != 1 {
		t.Fatalf("queue holds %d jobs, want 1", n)
	}
}

// An empty claim's candidate must come after every transaction that holds
// an id up to its S, the newest writer included: a snapshot's xmax is one
// past the latest *completed* transaction id, and an open transaction that
// took the newest id is not below it (with xmax as X, the mark passed such
// a row while its transaction was open, and it reached Redis after the
// rows staged after it: TestQueueGroups saw two jobs of a queue swapped).
// On a server of its own, so that no later transaction completes while
// the writer is open.
func TestEmptyClaimsDoNotPassAnOpenID(t *testing.T) {
	t.Parallel()
	h, pg := privateHarness(t)
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	// The poll wakes the relay: a notification would take a transaction
	// id of its own (PostgreSQL's NOTIFY does), and its commit would move
	// the latest completed one past the writer's.
	cfg.PollInterval = 50 * time.Millisecond
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.SetProbeEvery(r, time.Hour) // not while the test runs
	claims := make(chan int, 1000)
	relay.SetOnClaim(r, func(n int) {
		select {
		case claims <- n:
		default:
		}
	})
	h.run(r)
	h.firstJobToMark(r)

	ctx := context.Background()
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	writer := testenv.Conn(t, pg.URL())
	tx, err := writer.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var open int64
	if err := tx.QueryRow(ctx, `INSERT INTO `+table+` (job_name, job_args) VALUES ('Open', '[]') RETURNING id`).Scan(&open); err != nil {
		t.Fatal(err)
	}
	// Claims that find nothing, the fallback poll's.
	for len(claims) > 0 {
		<-claims
	}
	for range 5 {
		select {
		case <-claims:
		case <-time.After(15 * time.Second):
			t.Fatal("no claim within 15s")
		}
	}
	if l, _ := relay.LowWater(r); l >= open {
		t.Fatalf("low-water mark %d passed id %d, whose transaction is still open", l, open)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	h.waitQueueLen("default", 2, 15*time.Second)
	waitMark(t, r, open)
}

// A fleet takes its schemas' leads in one round trip, so their probes
// below the low-water mark start together. Each waiting the same interval,
// a fleet of 200 ran 200 probes at once every probeEvery on the drain
// pool's sessions, ahead of the drains (all 200 timed out together at the
// bench's start beside the app's full speed). Each probe now waits its
// interval less up to a quarter of it at random: the schemas' first turns
// spread over that quarter, and none comes sooner than 3/4 of it.
func TestFleetProbesDoNotRunTogether(t *testing.T) {
	t.Parallel()
	const n = 20
	const every = time.Second
	fh := newFleetHarness(t, n)
	var mu sync.Mutex
	first := map[string]time.Duration{}
	startCoolFleet(t, fh, func(r *relay.Relay) {
		relay.SetProbeEvery(r, every)
		relay.SetOnProbeTurn(r, func(schema string, since time.Duration) {
			mu.Lock()
			defer mu.Unlock()
			if _, ok := first[schema]; !ok {
				first[schema] = since
			}
		})
	})
	testenv.WaitFor(t, 30*time.Second, fmt.Sprintf("a first probe turn in each of %d schemas", n), func() (bool, string) {
		mu.Lock()
		defer mu.Unlock()
		return len(first) == n, fmt.Sprintf("%d: %v", len(first), first)
	})
	mu.Lock()
	defer mu.Unlock()
	lo, hi := time.Duration(math.MaxInt64), time.Duration(0)
	for schema, d := range first {
		if d < every*3/4 {
			t.Errorf("%s: first probe turn %v after the probe began, sooner than 3/4 of %v", schema, d, every)
		}
		lo, hi = min(lo, d), max(hi, d)
	}
	// 20 waits spread at random over 250ms span less than 100ms about
	// once in two million runs; waiting 1s each, they span the timers'
	// lateness, a few milliseconds.
	if hi-lo < 100*time.Millisecond {
		t.Errorf("the %d schemas' first probe turns came %v to %v after their probes began: together (want spread over a quarter of %v)", n, lo, hi, every)
	}
}
