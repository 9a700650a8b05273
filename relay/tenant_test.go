package relay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// tenantRows stages, in h's schema, the rows of the tenant tests: a job
// whose options name no tenant, one naming its own schema, one naming
// another tenant and one naming a tenant by a number. It returns their
// jids in that order.
func tenantRows(h *harness, extra ...map[string]any) []string {
	h.t.Helper()
	jobs := []relay.Job{
		{Name: "TenantJob", Args: []any{1}},
		{Name: "TenantJob", Args: []any{2}, Options: map[string]any{"apartment": h.schema}},
		{Name: "TenantJob", Args: []any{3}, Options: map[string]any{"apartment": "tenant_other"}},
		{Name: "TenantJob", Args: []any{4}, Options: map[string]any{"apartment": 7}},
	}
	for i, o := range extra {
		jobs = append(jobs, relay.Job{Name: "TenantJob", Args: []any{5 + i}, Options: o})
	}
	return h.stageMany(jobs...)
}

// With TenantKey, each target writes the schema's name into every job
// where its workers read it, once, whether the row's options named it or
// not; a row whose options name another tenant (or a non-string) is
// dead-lettered with a reason naming both, and never reaches Redis.
func TestTenantKeyPlacesSchemaAndDeadLettersOthers(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("sidekiq", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		cfg := h.config()
		cfg.TenantKey = "apartment"
		h.start(cfg)
		jids := tenantRows(h)
		h.waitQueueLen("default", 2, 15*time.Second)
		raw, err := h.rdb.LRange(ctx, h.key("queue:default"), 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		got := map[string]string{}
		for _, p := range raw {
			j := decodeJob(t, p)
			got[j.jid()] = fmt.Sprint(j["apartment"])
			if n := strings.Count(p, `"apartment":`); n != 1 {
				t.Errorf("job %s holds the key %d times, want once: %s", j.jid(), n, p)
			}
		}
		checkTenants(t, got, map[string]string{jids[0]: h.schema, jids[1]: h.schema})
		h.waitStaged(0)
		h.checkDead("tenant mismatch", jids[2], jids[3])
		checkDeadReasons(t, h, h.schema, `"tenant_other"`, "7")
	})

	t.Run("streams", func(t *testing.T) {
		t.Parallel()
		h := newHarness(t)
		cfg := h.config()
		cfg.Target, cfg.TenantKey = relay.TargetStreams, "apartment"
		h.start(cfg)
		jids := tenantRows(h)
		var entries []redis.XMessage
		testenv.WaitFor(t, 15*time.Second, "2 stream entries", func() (bool, string) {
			var err error
			entries, err = h.rdb.XRange(ctx, h.key("stream:default"), "-", "+").Result()
			return len(entries) == 2, fmt.Sprintf("%d entries (%v); logs %v", len(entries), err, messages(h.logs))
		})
		got := map[string]string{}
		for _, e := range entries {
			got[fmt.Sprint(e.Values["jid"])] = fmt.Sprint(e.Values["apartment"])
		}
		checkTenants(t, got, map[string]string{jids[0]: h.schema, jids[1]: h.schema})
		h.waitStaged(0)
		h.checkDead("tenant mismatch", jids[2], jids[3])
		checkDeadReasons(t, h, h.schema, `"tenant_other"`, "7")
	})

	t.Run("asynq", func(t *testing.T) {
		t.Parallel()
		h, rdb, cfg := newAsynqHarness(t)
		cfg.TenantKey = "apartment"
		h.start(cfg)
		// asynq: the "headers" option is where the tenant goes, so it is
		// checked too.
		jids := tenantRows(h, map[string]any{"headers": map[string]string{"apartment": "tenant_other", "trace": "t"}},
			map[string]any{"headers": map[string]string{"apartment": h.schema, "trace": "t"}})
		inspector := asynq.NewInspectorFromRedisClient(rdb)
		var tasks []*asynq.TaskInfo
		testenv.WaitFor(t, 15*time.Second, "3 pending tasks", func() (bool, string) {
			var err error
			tasks, err = inspector.ListPendingTasks("default")
			return len(tasks) == 3, fmt.Sprintf("%d tasks (%v); logs %v", len(tasks), err, messages(h.logs))
		})
		got := map[string]string{}
		for _, task := range tasks {
			got[task.ID] = task.Headers["apartment"]
			if task.ID == jids[5] && task.Headers["trace"] != "t" {
				t.Errorf("task %s headers %v, want its own header trace beside the tenant's", task.ID, task.Headers)
			}
			if string(task.Payload) != fmt.Sprintf("[%d]", slices.Index(jids, task.ID)+1) {
				t.Errorf("task %s payload %s, want the job_args alone", task.ID, task.Payload)
			}
		}
		checkTenants(t, got, map[string]string{jids[0]: h.schema, jids[1]: h.schema, jids[5]: h.schema})
		h.waitStaged(0)
		h.checkDead("tenant mismatch", jids[2], jids[3], jids[4])
		checkDeadReasons(t, h, h.schema, `"tenant_other"`, "7", `"tenant_other"`)
	})

	t.Run("sidekiq_staged_push", func(t *testing.T) {
		t.Parallel()
		h := newStagedPushHarness(t)
		if _, err := relay.Migrate(ctx, h.conn, h.schema, relay.WithSource(relay.SourceSidekiqStagedPush)); err != nil {
			t.Fatal(err)
		}
		cfg := h.config()
		cfg.Source, cfg.TenantKey = relay.SourceSidekiqStagedPush, "apartment"
		// The gem's payload is the whole job hash: the tenant, when the
		// app wrote one, is a top-level key of it.
		ids := h.pushStaged(`{"class":"TenantJob","args":[1],"jid":"000000000000000000000001"}`,
			`{"class":"TenantJob","args":[2],"jid":"000000000000000000000002","apartment":"`+h.schema+`"}`,
			`{"class":"TenantJob","args":[3],"jid":"000000000000000000000003","apartment":"tenant_other"}`)
		poison := h.gemRows()[2]
		h.start(cfg)
		h.waitGemQueueLen("default", 2, 15*time.Second)
		got := map[string]string{}
		for _, j := range h.queue("default") {
			got[j.jid()] = fmt.Sprint(j["apartment"])
		}
		checkTenants(t, got, map[string]string{"000000000000000000000001": h.schema, "000000000000000000000002": h.schema})
		// The gem's table has no dead-letter table: the row stays, as it
		// was, skipped.
		testenv.WaitFor(t, 10*time.Second, "the other tenant's row alone left", func() (bool, string) {
			rows := h.gemRows()
			return slices.Equal(rows, []string{poison}), fmt.Sprintf("rows %v", rows)
		})
		h.waitLog("poison job left staged, skipped until the relay's next leadership", 1)
		e := h.logs.FilterMessage("poison job left staged, skipped until the relay's next leadership").All()[0].ContextMap()
		if e["id"] != ids[2] || !strings.Contains(fmt.Sprint(e["reason"]), `tenant mismatch: the job names tenant "tenant_other" under "apartment", but it was staged in schema "`+h.schema+`"`) {
			t.Errorf("poison line %v, want row %d with a reason naming tenant_other and %s", e, ids[2], h.schema)
		}
	})
}

// checkTenants compares the tenant each job carried, by jid, with want.
func checkTenants(t *testing.T, got, want map[string]string) {
	t.Helper()
	for jid, schema := range want {
		if got[jid] != schema {
			t.Errorf("job %s carries tenant %q, want its schema %q (all: %v)", jid, got[jid], schema, got)
		}
	}
	if len(got) != len(want) {
		t.Errorf("jobs delivered %v, want only %v", got, want)
	}
}

// checkDeadReasons checks that the dead rows' reasons, in id order, name
// the tenant each row gave and the schema it was staged in.
func checkDeadReasons(t *testing.T, h *harness, schema string, given ...string) {
	t.Helper()
	dead := h.dead()
	for i, d := range dead {
		if i >= len(given) || !strings.Contains(d.reason, given[i]) || !strings.Contains(d.reason, fmt.Sprintf("%q", schema)) ||
			!strings.Contains(d.reason, `"apartment"`) {
			t.Errorf("dead row %d: reason %q, want one naming %s, the schema %q and the tenant key", d.id, d.reason, given[min(i, len(given)-1)], schema)
		}
	}
}

// A fleet of two schemas with TenantKey "apartment" drains into one Redis,
// where a real Sidekiq runs the jobs behind a plain-Ruby server middleware
// that switches to item['apartment'], as apartment-sidekiq's does
// (testdata/tenant_worker.rb): each job runs in its own schema's tenant,
// though neither app staged one.
func TestTenantKeySidekiqFleet(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	fh := newFleetHarness(t, 2)
	srv := testenv.StartRedis(t)
	opts, _ := redis.ParseURL(srv.URL())
	rdb := redis.NewClient(testenv.RedisOptions(opts))
	t.Cleanup(func() { _ = rdb.Close() })
	cfg := fh.fleetConfig()
	cfg.Redis, cfg.RedisNamespace, cfg.TenantKey = rdb, "", "apartment"
	out := testenv.StartSidekiq(t, "testdata/tenant_worker.rb", srv.URL())
	fh.start(cfg)

	want := map[string]string{}
	for _, schema := range fh.schemas {
		var jid string
		err := pgx.BeginFunc(ctx, fh.conn, func(tx pgx.Tx) error {
			var err error
			jid, err = relay.NewStager(schema).Stage(ctx, tx, relay.Job{Name: "TenantJob", Args: []any{schema}})
			return err
		})
		if err != nil {
			t.Fatalf("stage in %s: %v", schema, err)
		}
		want[jid] = schema
	}
	var seen map[string]string
	testenv.WaitFor(t, 60*time.Second, "Sidekiq to run a job of each schema", func() (bool, string) {
		var err error
		seen, err = rdb.HGetAll(ctx, "tenant_seen").Result()
		return len(seen) == len(want), fmt.Sprintf("seen %v (%v); worker output:\n%s\nrelay logs: %v", seen, err, out.String(), messages(fh.logs))
	})
	for jid, schema := range want {
		var tenant *string
		if err := json.Unmarshal([]byte(seen[jid]), &tenant); err != nil || tenant == nil || *tenant != schema {
			t.Errorf("job %s of schema %s ran in tenant %s, want %q", jid, schema, seen[jid], schema)
		}
	}
}
