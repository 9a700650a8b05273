package relay_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// newStagedPushHarness is a harness whose schema holds the
// sidekiq-staged_push gem's table, created as the gem's migration does
// (create_table with t.json :payload, null: false and t.timestamps), and
// nothing of stagedrain's.
func newStagedPushHarness(t *testing.T) *harness {
	t.Helper()
	h := &harness{t: t, schema: testenv.Schema(t)}
	h.rdb, h.ns = testenv.Redis(t)
	h.conn = testenv.Conn(t, testenv.DatabaseURL())
	if _, err := h.conn.Exec(context.Background(), `CREATE SCHEMA `+pgx.Identifier{h.schema}.Sanitize()+`;`+gemTableSQL(t, h.schema)); err != nil {
		t.Fatalf("create the gem's table: %v", err)
	}
	return h
}

// gemTableSQL creates the sidekiq-staged_push gem's table
// (../testdata/sidekiq_staged_push_jobs.sql) in schema, which exists.
func gemTableSQL(t *testing.T, schema string) string {
	b, err := os.ReadFile("../testdata/sidekiq_staged_push_jobs.sql")
	if err != nil {
		t.Fatal(err)
	}
	return "SET search_path TO " + pgx.Identifier{schema}.Sanitize() + ";\n" + string(b) + "RESET search_path;"
}

// gemTable is the gem's table in h's schema, quoted.
func (h *harness) gemTable() string {
	return pgx.Identifier{h.schema, "sidekiq_staged_push_jobs"}.Sanitize()
}

// pushStaged inserts payloads in one transaction, as the gem does: the
// JSON as given, timestamps in UTC as Rails writes them. It returns the ids.
func (h *harness) pushStaged(payloads ...string) []int64 {
	h.t.Helper()
	var ids []int64
	err := pgx.BeginFunc(context.Background(), h.conn, func(tx pgx.Tx) error {
		for _, p := range payloads {
			var id int64
			if err := tx.QueryRow(context.Background(), `INSERT INTO `+h.gemTable()+` (payload, created_at, updated_at)
				VALUES ($1::json, now() AT TIME ZONE 'UTC', now() AT TIME ZONE 'UTC') RETURNING id`, p).Scan(&id); err != nil {
				return err
			}
			ids = append(ids, id)
		}
		return nil
	})
	if err != nil {
		h.t.Fatalf("insert into sidekiq_staged_push_jobs: %v", err)
	}
	return ids
}

// gemRows returns the gem table's rows as JSON text (to_json of each), by id.
func (h *harness) gemRows() []string {
	h.t.Helper()
	rows, err := h.conn.Query(context.Background(), `SELECT to_json(t)::text FROM `+h.gemTable()+` t ORDER BY id`)
	if err != nil {
		h.t.Fatalf("read sidekiq_staged_push_jobs: %v", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		h.t.Fatalf("read sidekiq_staged_push_jobs: %v", err)
	}
	return out
}

// waitGemQueueLen waits until queue:<q> holds n jobs.
func (h *harness) waitGemQueueLen(q string, n int64, timeout time.Duration) {
	h.t.Helper()
	testenv.WaitFor(h.t, timeout, fmt.Sprintf("%d jobs in queue:%s", n, q), func() (bool, string) {
		got, err := h.rdb.LLen(context.Background(), h.key("queue:"+q)).Result()
		if err != nil && !errors.Is(err, redis.Nil) {
			return false, err.Error()
		}
		return got == n, fmt.Sprintf("%d jobs, %d rows staged; logs %v", got, len(h.gemRows()), messages(h.logs))
	})
}

var hex24 = regexp.MustCompile(`^[0-9a-f]{24}$`)

// The relay drains the gem's table into Sidekiq's layout, completing each
// job as Sidekiq's client would; migrate adds only triggers, and a
// commit wakes the relay by NOTIFY, not by the poll.
func TestStagedPushSource(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newStagedPushHarness(t)
	cfg := h.config()
	cfg.Source = relay.SourceSidekiqStagedPush
	cfg.PollInterval = time.Minute // only a NOTIFY delivers within the test's wait

	// Before migrate: the relay refuses to start, and says what to run.
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithTimeout(ctx, 15*time.Second)
	err = r.Run(runCtx)
	cancel()
	if !errors.Is(err, relay.ErrNotMigrated) || !strings.Contains(err.Error(), "run 'stagedrain migrate --source sidekiq_staged_push' first") ||
		strings.Contains(err.Error(), "\n") {
		t.Fatalf("Run before migrate: %v, want one line of ErrNotMigrated naming 'stagedrain migrate --source sidekiq_staged_push'", err)
	}

	runErr := func() error {
		t.Helper()
		r, err := relay.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		runCtx, cancel := context.WithTimeout(ctx, 15*time.Second)
		defer cancel()
		return r.Run(runCtx)
	}
	migrate := func(want ...string) {
		t.Helper()
		res, err := relay.Migrate(ctx, h.conn, h.schema, relay.WithSource(relay.SourceSidekiqStagedPush))
		if err != nil {
			t.Fatalf("migrate: %v", err)
		}
		if len(res.Applied) != len(want) {
			t.Fatalf("migrate applied %v, want %d step(s) %v", res.Applied, len(want), want)
		}
		for i, w := range want {
			if !strings.Contains(res.Applied[i], w) {
				t.Errorf("migrate applied %v, want %v", res.Applied, want)
			}
		}
	}
	migrate("stagedrain_wake()", "stagedrain_wake trigger", "stagedrain_xid_first trigger")
	migrate() // idempotent
	// The trigger's comment names the stagedrain_wake() it runs: an older
	// one is refused until migrate replaces it, a newer one for good.
	comment := func(c string) {
		t.Helper()
		if _, err := h.conn.Exec(ctx, `COMMENT ON TRIGGER stagedrain_wake ON `+h.gemTable()+` IS '`+c+`'`); err != nil {
			t.Fatal(err)
		}
	}
	comment("stagedrain_wake 3")
	if err := runErr(); !errors.Is(err, relay.ErrNotMigrated) || !strings.Contains(err.Error(), "older") {
		t.Fatalf("Run with an older trigger: %v, want ErrNotMigrated", err)
	}
	migrate("stagedrain_wake()")
	comment("stagedrain_wake 999")
	if err := runErr(); !errors.Is(err, relay.ErrSchemaTooNew) {
		t.Fatalf("Run with a newer trigger: %v, want ErrSchemaTooNew", err)
	}
	if _, err := relay.Migrate(ctx, h.conn, h.schema, relay.WithSource(relay.SourceSidekiqStagedPush)); err == nil || !strings.Contains(err.Error(), "newer") {
		t.Fatalf("migrate over a newer trigger: %v, want a refusal", err)
	}
	comment("stagedrain_wake 3")
	migrate("stagedrain_wake()")
	// Only the triggers and their functions (and the mark's reader of the
	// sequence): no table, no view, no sequence beyond the gem's own.
	rows, err := h.conn.Query(ctx, `SELECT relname || ':' || relkind::text FROM pg_class
		WHERE relnamespace = $1::regnamespace AND relkind IN ('r', 'p', 'v', 'm', 'S', 'f') ORDER BY 1`, h.schema)
	if err != nil {
		t.Fatal(err)
	}
	rels, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"sidekiq_staged_push_jobs:r", "sidekiq_staged_push_jobs_id_seq:S"}; !slices.Equal(rels, want) {
		t.Fatalf("schema holds %v after migrate, want only the gem's %v", rels, want)
	}
	var triggers, functions []string
	if err := h.conn.QueryRow(ctx, `SELECT
		ARRAY(SELECT tgname::text FROM pg_trigger WHERE tgrelid = $1::regclass AND NOT tgisinternal ORDER BY 1),
		ARRAY(SELECT proname::text FROM pg_proc WHERE pronamespace = $2::regnamespace ORDER BY 1)`, h.gemTable(), h.schema).Scan(&triggers, &functions); err != nil {
		t.Fatal(err)
	}
	if want := []string{"stagedrain_wake", "stagedrain_xid_first"}; !slices.Equal(triggers, want) {
		t.Fatalf("triggers %v on the gem's table, want %v", triggers, want)
	}
	if want := []string{"stagedrain_staged_push_last_id", "stagedrain_wake", "stagedrain_xid_first"}; !slices.Equal(functions, want) {
		t.Fatalf("functions %v in the schema, want %v", functions, want)
	}

	_, idle := h.startSignaled(cfg)
	h.waitIdleAfterListen(idle)

	now := time.Now()
	future := float64(now.Add(time.Hour).UnixMicro()) / 1e6
	past := float64(now.Add(-time.Minute).UnixMicro()) / 1e6
	h.pushStaged(
		`{"class":"HardWorker","args":[1,"x"]}`,
		`{"class":"HardWorker","args":[2],"queue":"critical","jid":"0123456789abcdef01234567","retry":3,"backtrace":true,"tags":["t"],"bid":"b1"}`,
		fmt.Sprintf(`{"class":"LaterWorker","args":[3],"at":%f}`, future),
		fmt.Sprintf(`{"class":"LateWorker","args":[4],"at":%f,"enqueued_at":1.5}`, past),
	)
	committed := time.Now()
	h.waitGemQueueLen("default", 2, 10*time.Second)
	h.waitGemQueueLen("critical", 1, 10*time.Second)
	if d := time.Since(committed); d > 5*time.Second {
		t.Errorf("jobs arrived %s after the commit: woken by the poll, not NOTIFY", d)
	}
	testenv.WaitFor(t, 10*time.Second, "the gem's table empty", func() (bool, string) {
		n := len(h.gemRows())
		return n == 0, fmt.Sprintf("%d rows", n)
	})

	def := h.queue("default")
	raw, late := def[0], def[1]
	if raw["class"] != "HardWorker" || fmt.Sprint(raw["args"]) != "[1 x]" || raw["queue"] != "default" || raw["retry"] != true ||
		!hex24.MatchString(raw.jid()) || len(raw) != 7 {
		t.Errorf("raw job %v, want class, args, queue default, retry true, a 24-hex jid, created_at, enqueued_at", raw)
	}
	for _, j := range []sidekiqJob{raw, late} {
		created, _ := j["created_at"].(float64)
		enq, _ := j["enqueued_at"].(float64)
		if created < float64(now.Add(-time.Second).Unix()) || created > float64(committed.Unix()+1) ||
			enq < created || enq > float64(time.Now().Unix()+1) {
			t.Errorf("job %v: created_at %f (want the row's), enqueued_at %f (want the push's)", j, created, enq)
		}
		if _, ok := j["at"]; ok {
			t.Errorf("job %v keeps at", j)
		}
	}
	if late["class"] != "LateWorker" || late["enqueued_at"] == 1.5 {
		t.Errorf("job whose at is past: %v, want LateWorker pushed now with a new enqueued_at", late)
	}
	crit := h.queue("critical")[0]
	if crit.jid() != "0123456789abcdef01234567" || crit["retry"] != float64(3) || crit["backtrace"] != true ||
		fmt.Sprint(crit["tags"]) != "[t]" || crit["bid"] != "b1" || crit["queue"] != "critical" {
		t.Errorf("job with queue and jid: %v, want its jid, queue, retry 3, backtrace, tags and bid unchanged", crit)
	}
	jobs, scores := h.scheduled()
	if len(jobs) != 1 || jobs[0]["class"] != "LaterWorker" || scores[0] < future-0.001 || scores[0] > future+0.001 {
		t.Fatalf("schedule %v %v, want LaterWorker at %f", jobs, scores, future)
	}
	if _, ok := jobs[0]["at"]; ok || jobs[0]["enqueued_at"] != nil || !hex24.MatchString(jobs[0].jid()) {
		t.Errorf("scheduled job %v: want no at, no enqueued_at, a 24-hex jid", jobs[0])
	}
}

// A row no worker could run (a payload that is not an object, no class)
// stays in the gem's table unchanged, logged once at error; the rows
// behind it flow on, and the summary line counts it.
func TestStagedPushPoison(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newStagedPushHarness(t)
	if _, err := relay.Migrate(ctx, h.conn, h.schema, relay.WithSource(relay.SourceSidekiqStagedPush)); err != nil {
		t.Fatal(err)
	}
	cfg := h.config()
	cfg.Source = relay.SourceSidekiqStagedPush
	poison := h.pushStaged(`[1, 2]`, `{"args": [1],  "queue": "q"}`, `"HardWorker"`, `{"class":"W","args":[1],"at":"soon"}`,
		`{"class":"W","args":[1],"at":1e300}`, `{"class":"W","args":[1],"created_at":-1e300}`)
	// created_at 'infinity' and '-infinity' (Rails writes them for
	// Float::INFINITY): no time can hold them; before, they became a
	// created_at of year -290,000 in the payload, and the summary's oldest
	// row failed to scan.
	for _, at := range []string{"infinity", "-infinity"} {
		var id int64
		if err := h.conn.QueryRow(ctx, `INSERT INTO `+h.gemTable()+` (payload, created_at, updated_at)
			VALUES ('{"class":"W","args":[1]}', $1::timestamp, now() AT TIME ZONE 'UTC') RETURNING id`, at).Scan(&id); err != nil {
			t.Fatal(err)
		}
		poison = append(poison, id)
	}
	before := h.gemRows()
	h.pushStaged(`{"class":"Good","args":[1]}`)
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	relay.SetSummaryEvery(r, 50*time.Millisecond)
	h.run(r)
	h.waitGemQueueLen("default", 1, 10*time.Second)

	// Another drain: the poison is skipped, not claimed and logged again.
	h.pushStaged(`{"class":"Good","args":[2]}`)
	h.waitGemQueueLen("default", 2, 10*time.Second)
	testenv.WaitFor(t, 10*time.Second, "the good rows deleted", func() (bool, string) {
		n := len(h.gemRows())
		return n == len(poison), fmt.Sprintf("%d rows", n)
	})
	if after := h.gemRows(); !slices.Equal(after, before) {
		t.Errorf("poison rows after the drain:\n%v\nwant them unchanged:\n%v", after, before)
	}
	logged := h.logs.FilterMessage("poison job left staged, skipped until the relay's next leadership").All()
	if len(logged) != len(poison) {
		t.Fatalf("%d poison lines, want one per row (%d): %v", len(logged), len(poison), messages(h.logs))
	}
	reasons := map[int64]string{}
	for _, e := range logged {
		reasons[e.ContextMap()["id"].(int64)] = fmt.Sprint(e.ContextMap()["reason"])
	}
	for i, want := range []string{"not a JSON object", `no "class"`, "not a JSON object", `"at" is not a number`,
		`payload's "at" is out of range`, `payload's "created_at" is out of range`,
		"created_at is infinity: Go and the job systems cannot hold it", "created_at is -infinity: Go and the job systems cannot hold it"} {
		if !strings.Contains(reasons[poison[i]], want) {
			t.Errorf("row %d: reason %q, want one naming %q", poison[i], reasons[poison[i]], want)
		}
	}
	// The backlog counts the poison rows, their infinite created_at aside.
	// A summary from before the second good row was drained counts it too:
	// wait for one from after.
	testenv.WaitFor(t, 10*time.Second, fmt.Sprintf("a summary line with poison_staged and backlog %d", len(poison)), func() (bool, string) {
		for _, e := range h.logs.FilterMessage("drained").All() {
			if f := e.ContextMap(); f["poison_staged"] == int64(len(poison)) && f["backlog"] == int64(len(poison)) {
				return true, ""
			}
		}
		return false, fmt.Sprint(h.logs.FilterMessage("drained").All())
	})
	if n, err := h.rdb.Exists(ctx, h.key("queue:q")).Result(); err != nil || n != 0 {
		t.Errorf("queue:q exists (%d, %v): a poison row was pushed", n, err)
	}
}

// The same source with the streams target: an entry per job, one whose at
// is in the future left in the table until it is due.
func TestStagedPushStreams(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newStagedPushHarness(t)
	if _, err := relay.Migrate(ctx, h.conn, h.schema, relay.WithSource(relay.SourceSidekiqStagedPush)); err != nil {
		t.Fatal(err)
	}
	cfg := h.config()
	cfg.Source, cfg.Target = relay.SourceSidekiqStagedPush, relay.TargetStreams
	cfg.PollInterval = time.Minute
	stream := h.key("stream:default")
	runAt := time.Now().Add(1500 * time.Millisecond)
	h.pushStaged(`{"class":"Now","args":[1],"tags":["a"]}`,
		fmt.Sprintf(`{"class":"Later","args":[2],"at":%f}`, float64(runAt.UnixMicro())/1e6))
	r := h.start(cfg)
	read := func() map[string]any {
		t.Helper()
		res, err := h.rdb.XRead(ctx, &redis.XReadArgs{Streams: []string{stream, "0"}, Count: 10, Block: 10 * time.Second}).Result()
		if err != nil {
			t.Fatalf("XREAD: %v; logs: %v", err, messages(h.logs))
		}
		return res[0].Messages[len(res[0].Messages)-1].Values
	}
	e := read()
	// The gem's "at" has no index to find due rows below a mark by: this
	// crossing claims from the index's start, and says so.
	h.waitLog("claims start at the id index's start: a target with no scheduler finds the due rows below the mark by their run_at, which this table has no index of", 1)
	if l, on := relay.LowWater(r); on {
		t.Fatalf("low-water mark on (%d) for the gem's table with the streams target", l)
	}
	if e["class"] != "Now" || e["args"] != "[1]" || e["queue"] != "default" || e["options"] != `{"tags":["a"]}` ||
		!hex24.MatchString(fmt.Sprint(e["jid"])) {
		t.Fatalf("entry %v, want class Now, args [1], queue default, options {\"tags\":[\"a\"]}, a 24-hex jid", e)
	}
	testenv.WaitFor(t, 10*time.Second, "the later job's entry", func() (bool, string) {
		n, err := h.rdb.XLen(ctx, stream).Result()
		return n == 2, fmt.Sprintf("%d entries (%v), %d rows", n, err, len(h.gemRows()))
	})
	if time.Now().Before(runAt) {
		t.Fatalf("the later job was added before its at")
	}
	last, err := h.rdb.XRevRangeN(ctx, stream, "+", "-", 1).Result()
	if err != nil || last[0].Values["class"] != "Later" {
		t.Fatalf("last entry %v (%v), want Later", last, err)
	}
	if n := len(h.gemRows()); n != 0 {
		testenv.WaitFor(t, 5*time.Second, "the gem's table empty", func() (bool, string) {
			n := len(h.gemRows())
			return n == 0, fmt.Sprintf("%d rows", n)
		})
	}
}
