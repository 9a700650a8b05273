package target_test

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/stagedrain/stagedrain/relay/internal/golden"
	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	"github.com/stagedrain/stagedrain/relay/internal/target"
)

// The targets' golden files, testdata/*.json at the top of the module:
// what each builder writes for fixed rows at a fixed time (the harness,
// relay/internal/golden, shows each argument decoded beside it). Those of
// rows as the relay's sources read them are relay's golden tests.

// builder is the target named name's Builder, made by its Spec's New.
func builder(name string, o target.Options) target.Builder {
	s, ok := target.Lookup(name)
	if !ok {
		panic("no target " + name)
	}
	return s.New(o)
}

// build runs b over jobs as a push at golden.Now would, and returns the
// ops it built; no row may be rejected.
func build(t *testing.T, b target.Builder, jobs []target.Job) []golden.Op {
	t.Helper()
	var u handoff.Unit
	var res target.Result
	b.Add(&u, jobs, golden.Now, &res)
	if len(res.Rejected) > 0 {
		t.Fatalf("rejected: %v", res.Rejected)
	}
	return golden.Ops(t, &u)
}

// checkGolden compares f with testdata/<name> at the top of the module, or
// writes it there under -update.
func checkGolden(t *testing.T, name string, f golden.File) {
	t.Helper()
	golden.Check(t, filepath.Join("..", "..", ".."), name, f, *update)
}

func TestGoldenSidekiq(t *testing.T) {
	t.Parallel()
	earlier := golden.Now.Add(-time.Minute)
	immediate := []target.Job{
		golden.Job(1, "WelcomeJob", `[42, "ada@example.com"]`, "default", nil, `{}`),
		golden.Job(2, "ReceiptJob", `[{"order": 7}]`, "default", &earlier, `{"retry": 5, "tags": ["billing"]}`),
		golden.Job(3, "AuditJob", `[]`, "low", nil, `{"retry": false}`),
	}
	scheduled := []target.Job{
		golden.Job(1, "ReminderJob", `[42]`, "default", &golden.Later, `{}`),
		golden.Job(2, "ReportJob", `["weekly"]`, "reports", &golden.Later, `{"backtrace": 10}`),
	}
	for _, c := range []struct {
		file string
		what string
		jobs []target.Job
		ts   string
	}{
		{"sidekiq_immediate_seconds.json", "Immediate jobs (run_at NULL or past), created_at and enqueued_at as float epoch seconds (Sidekiq 7 and older)", immediate, "seconds"},
		{"sidekiq_immediate_millis.json", "Immediate jobs (run_at NULL or past), created_at and enqueued_at as integer epoch milliseconds (Sidekiq 8)", immediate, "millis"},
		{"sidekiq_scheduled_seconds.json", "Scheduled jobs (run_at in the future): ZADD schedule, score run_at in float epoch seconds, no enqueued_at; created_at in float epoch seconds (Sidekiq 7 and older)", scheduled, "seconds"},
		{"sidekiq_scheduled_millis.json", "Scheduled jobs (run_at in the future): ZADD schedule, score run_at in float epoch seconds (in both formats), no enqueued_at; created_at in integer epoch milliseconds (Sidekiq 8)", scheduled, "millis"},
	} {
		checkGolden(t, c.file, golden.File{Case: c.what, Target: "sidekiq", Timestamps: c.ts, Now: golden.Now,
			Rows: golden.Rows(c.jobs), Ops: build(t, builder("sidekiq", target.Options{MaxPayload: 1 << 20, Millis: c.ts == "millis"}), c.jobs)})
	}
}

func TestGoldenAsynq(t *testing.T) {
	t.Parallel()
	plain := []target.Job{golden.Job(1, "email:welcome", `[42, "ada@example.com"]`, "default", nil,
		`{"retry": 3, "timeout": 60, "headers": {"trace": "abc"}}`)}
	checkGolden(t, "asynq_task.json", golden.File{
		Case:   "An immediate asynq task: HSET asynq:{queue}:t:<jid> msg (a protobuf TaskMessage; decoded beside it), state pending, pending_since (unix nanoseconds); LPUSH asynq:{queue}:pending <jid>; skipped if the task key exists",
		Target: "asynq", Now: golden.Now, Rows: golden.Rows(plain), Ops: build(t, builder("asynq", target.Options{MaxPayload: 1 << 20}), plain)})
	sched := []target.Job{golden.Job(1, "report:weekly", `["weekly"]`, "reports", &golden.Later, `{"unique": 600}`)}
	checkGolden(t, "asynq_task_scheduled_unique.json", golden.File{
		Case:   "A scheduled asynq task with the unique option: the uniqueness lock (SET EX until run_at plus the TTL), HSET state scheduled, ZADD asynq:{queue}:scheduled <run_at epoch seconds>; skipped if the task key or the lock exists",
		Target: "asynq", Now: golden.Now, Rows: golden.Rows(sched), Ops: build(t, builder("asynq", target.Options{MaxPayload: 1 << 20}), sched)})
}

func TestGoldenStreams(t *testing.T) {
	t.Parallel()
	jobs := []target.Job{golden.Job(1, "WelcomeJob", `[42, "ada@example.com"]`, "default", nil, `{"retry": 5}`)}
	checkGolden(t, "streams_entry.json", golden.File{
		Case:   "A Redis Streams entry: XADD stream:<queue> (MAXLEN ~ when set) * with the fields jid, class, args, queue, created_at (epoch milliseconds) and options (left out when {})",
		Target: "streams", Now: golden.Now, Rows: golden.Rows(jobs), Ops: build(t, builder("streams", target.Options{MaxPayload: 1 << 20, StreamMaxLen: 100000}), jobs)})
}

func TestGoldenCelery(t *testing.T) {
	t.Parallel()
	fixed := func(n int) []string { // delivery tags: random UUIDs, fixed here
		out := make([]string, n)
		for i := range out {
			out[i] = fmt.Sprintf("00000000-0000-4000-8000-%012d", i+1)
		}
		return out
	}
	jobs := []target.Job{
		golden.Job(1, "myapp.tasks.send_welcome", `[42, "ada@example.com"]`, "celery", nil, `{}`),
		golden.Job(2, "myapp.tasks.charge", `[42]`, "billing", nil,
			`{"kwargs": {"amount": 1999, "currency": "usd"}, "priority": 5, "expires": 600, "time_limit": 30, "soft_time_limit": 25, "retries": 1, "headers": {"request_id": "r-7"}, "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}`),
		golden.Job(3, "myapp.tasks.audit", `[]`, "celery", nil, `{"priority": 9, "ignore_result": true, "shadow": "audit"}`),
	}
	tg := builder("celery", target.Options{MaxPayload: 1 << 20, UUIDs: fixed})
	checkGolden(t, "celery_task.json", golden.File{
		Case:   "Celery task messages (protocol 2 in Kombu's JSON envelope; body decoded beside each): LPUSH <queue> for priority 0-2 (the default 0), <queue>\\x06\\x163, 6 or 9 for higher numbers (Kombu's priority lists; on Redis a lower number runs first); options kwargs, expires (seconds after created_at), time limits, retries, custom headers and the trace context as headers",
		Target: "celery", Now: golden.Now, Rows: golden.Rows(jobs), Ops: build(t, tg, jobs)})
	tenant := []target.Job{golden.Job(1, "myapp.tasks.send_welcome", `[42]`, "celery", nil, `{"apartment": "tenant_acme"}`)}
	tg = builder("celery", target.Options{Namespace: "myapp", MaxPayload: 1 << 20, UUIDs: fixed, Tenant: target.NewTenant("apartment", "tenant_acme")})
	checkGolden(t, "celery_task_namespace_tenant.json", golden.File{
		Case:   "A Celery task with --redis-namespace myapp (the workers set Kombu's global_keyprefix to \"myapp:\") and --tenant-key apartment: the list is myapp:<queue>, the tenant a header (task.request.apartment)",
		Target: "celery", TenantKey: "apartment", Schema: "tenant_acme", Now: golden.Now, Rows: golden.Rows(tenant), Ops: build(t, tg, tenant)})
}

func TestGoldenBullMQ(t *testing.T) {
	t.Parallel()
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	standard := []target.Job{
		golden.Job(1, "welcome", `[42, "ada@example.com"]`, "mailers", nil, `{}`),
		golden.Job(2, "receipt", `[{"order": 7}]`, "mailers", nil,
			`{"attempts": 3, "backoff": 1000, "removeOnComplete": true, "keepLogs": 10, "unwrapData": true, "traceparent": "`+tp+`"}`),
		golden.Job(3, "audit", `[]`, "low", nil, `{"lifo": true, "backoff": {"type": "exponential", "delay": 500}}`),
	}
	prioritized := []target.Job{golden.Job(1, "urgent", `[7]`, "default", nil, `{"priority": 5}`)}
	delayed := []target.Job{golden.Job(1, "reminder", `[42]`, "default", &golden.Later, `{"attempts": 2}`)}
	for _, c := range []struct {
		file, what string
		jobs       []target.Job
	}{
		{"bullmq_standard.json", "Standard BullMQ 6.7.0 jobs, as Queue.add adds them (addStandardJob-9.lua), by the push script's Lua op bullmq.add: INCR <prefix>:<queue>:id; HSET meta opts.maxLenEvents 10000 if unset; HMSET <prefix>:<queue>:<jid> name data opts timestamp (created_at ms) delay 0 priority 0; XADD events added; LPUSH wait <jid> (RPUSH with lifo); ZADD marker 0 \"0\" unless meta says paused or the queue is at its concurrency; XADD events waiting. Skipped if the job key exists. Options: backoff milliseconds as BullMQ's fixed backoff, keepLogs as kl, traceparent as telemetry metadata (tm), unwrapData: data is job_args' only element", standard},
		{"bullmq_prioritized.json", "A prioritized BullMQ job (priority above 0; addPrioritizedJob-9.lua): INCR pc, ZADD prioritized priority*2^32 + pc, the marker and waiting event as a standard job's", prioritized},
		{"bullmq_delayed.json", "A delayed BullMQ job (run_at in the future; addDelayedJob-6.lua): delay = run_at - created_at ms, so it is due at run_at; ZADD delayed (run_at ms * 0x1000, plus one per job due in the same ms), XADD events delayed, ZADD marker <earliest due ms> \"1\"", delayed},
	} {
		checkGolden(t, c.file, golden.File{Case: c.what, Target: "bullmq", Now: golden.Now,
			Rows: golden.Rows(c.jobs), Ops: build(t, builder("bullmq", target.Options{Namespace: "bull", MaxPayload: 1 << 20}), c.jobs)})
	}
}

// The golden files of Config.TenantKey: where each target writes the
// schema's name, for a row that names no tenant and one that names its own
// schema (written once).
func TestGoldenTenant(t *testing.T) {
	t.Parallel()
	const key, schema = "apartment", "tenant_1"
	tag := target.NewTenant(key, schema)

	sidekiq := []target.Job{
		golden.Job(1, "WelcomeJob", `[42]`, "default", nil, `{}`),
		golden.Job(2, "ReceiptJob", `[7]`, "default", nil, `{"apartment": "tenant_1", "retry": 5}`),
		golden.Job(3, "ReminderJob", `[42]`, "default", &golden.Later, `{}`),
	}
	s := builder("sidekiq", target.Options{MaxPayload: 1 << 20, Tenant: tag})
	checkGolden(t, "sidekiq_tenant.json", golden.File{
		Case:   "Sidekiq with --tenant-key apartment in schema tenant_1: the schema's name is a top-level key of every job hash (immediate and scheduled), after the columns' keys, where apartment-sidekiq's server middleware reads item['apartment']; a row whose options name the same tenant has it once",
		Target: "sidekiq", Timestamps: "seconds", TenantKey: key, Schema: schema, Now: golden.Now,
		Rows: golden.Rows(sidekiq), Ops: build(t, s, sidekiq)})

	asynqJobs := []target.Job{golden.Job(1, "email:welcome", `[42]`, "default", nil, `{"headers": {"trace": "abc"}}`)}
	a := builder("asynq", target.Options{MaxPayload: 1 << 20, Tenant: tag})
	checkGolden(t, "asynq_task_tenant.json", golden.File{
		Case:   "asynq with --tenant-key apartment in schema tenant_1: the schema's name is a header of the task (TaskMessage field 15, Task.Headers()), beside the headers option; the payload stays the job_args JSON text",
		Target: "asynq", TenantKey: key, Schema: schema, Now: golden.Now,
		Rows: golden.Rows(asynqJobs), Ops: build(t, a, asynqJobs)})

	streamJobs := []target.Job{golden.Job(1, "WelcomeJob", `[42]`, "default", nil, `{}`)}
	st := builder("streams", target.Options{MaxPayload: 1 << 20, Tenant: tag})
	checkGolden(t, "streams_entry_tenant.json", golden.File{
		Case:   "A Redis Streams entry with --tenant-key apartment in schema tenant_1: the field apartment, with the schema's name, after created_at",
		Target: "streams", TenantKey: key, Schema: schema, Now: golden.Now,
		Rows: golden.Rows(streamJobs), Ops: build(t, st, streamJobs)})

}
