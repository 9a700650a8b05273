package relay

import (
	"strings"
	"testing"
	"time"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	targets "github.com/stagedrain/stagedrain/relay/internal/target"
)

func TestGoldenBullMQ(t *testing.T) {
	t.Parallel()
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	standard := []stagedJob{
		goldenJob(1, "welcome", `[42, "ada@example.com"]`, "mailers", nil, `{}`),
		goldenJob(2, "receipt", `[{"order": 7}]`, "mailers", nil,
			`{"attempts": 3, "backoff": 1000, "removeOnComplete": true, "keepLogs": 10, "unwrapData": true, "traceparent": "`+tp+`"}`),
		goldenJob(3, "audit", `[]`, "low", nil, `{"lifo": true, "backoff": {"type": "exponential", "delay": 500}}`),
	}
	prioritized := []stagedJob{goldenJob(1, "urgent", `[7]`, "default", nil, `{"priority": 5}`)}
	delayed := []stagedJob{goldenJob(1, "reminder", `[42]`, "default", &goldenLater, `{"attempts": 2}`)}
	for _, c := range []struct {
		file, what string
		jobs       []stagedJob
	}{
		{"bullmq_standard.json", "Standard BullMQ 6.7.0 jobs, as Queue.add adds them (addStandardJob-9.lua), by the push script's Lua op bullmq.add: INCR <prefix>:<queue>:id; HSET meta opts.maxLenEvents 10000 if unset; HMSET <prefix>:<queue>:<jid> name data opts timestamp (created_at ms) delay 0 priority 0; XADD events added; LPUSH wait <jid> (RPUSH with lifo); ZADD marker 0 \"0\" unless meta says paused or the queue is at its concurrency; XADD events waiting. Skipped if the job key exists. Options: backoff milliseconds as BullMQ's fixed backoff, keepLogs as kl, traceparent as telemetry metadata (tm), unwrapData: data is job_args' only element", standard},
		{"bullmq_prioritized.json", "A prioritized BullMQ job (priority above 0; addPrioritizedJob-9.lua): INCR pc, ZADD prioritized priority*2^32 + pc, the marker and waiting event as a standard job's", prioritized},
		{"bullmq_delayed.json", "A delayed BullMQ job (run_at in the future; addDelayedJob-6.lua): delay = run_at - created_at ms, so it is due at run_at; ZADD delayed (run_at ms * 0x1000, plus one per job due in the same ms), XADD events delayed, ZADD marker <earliest due ms> \"1\"", delayed},
	} {
		checkGolden(t, c.file, goldenFile{Case: c.what, Target: "bullmq", Now: goldenNow,
			Rows: rowsOf(c.jobs), Ops: build(t, builtin(TargetBullMQ, targets.Options{Namespace: "bull", MaxPayload: 1 << 20}), c.jobs)})
	}
}

// Rows BullMQ could not take are rejected, each with its reason.
func TestBullMQRejects(t *testing.T) {
	t.Parallel()
	later := goldenNow.Add(time.Hour)
	for _, c := range []struct {
		name    string
		job     stagedJob
		cluster bool
		reason  string // a part of the reason
	}{
		{"queue with a colon", goldenJob(1, "a", `[]`, "a:b", nil, `{}`), false, "contains ':', which BullMQ refuses in a queue name"},
		{"integer jid", stagedJob{id: 1, name: "a", args: []byte(`[]`), queue: "q", jid: "42", options: []byte(`{}`)}, false, "is an integer"},
		{"jid 0", stagedJob{id: 1, name: "a", args: []byte(`[]`), queue: "q", jid: "0", options: []byte(`{}`)}, false, "'0'"},
		{"jid with a colon", stagedJob{id: 1, name: "a", args: []byte(`[]`), queue: "q", jid: "a:b", options: []byte(`{}`)}, false, "contains ':'"},
		{"delay", goldenJob(1, "a", `[]`, "q", nil, `{"delay": 10}`), false, "with run_at"},
		{"jobId", goldenJob(1, "a", `[]`, "q", nil, `{"jobId": "x"}`), false, "the row's jid"},
		{"repeat", goldenJob(1, "a", `[]`, "q", nil, `{"repeat": {"every": 10}}`), false, "job schedulers"},
		{"parent", goldenJob(1, "a", `[]`, "q", nil, `{"parent": {"id": "p", "queue": "bull:q"}}`), false, "flows"},
		{"deduplication", goldenJob(1, "a", `[]`, "q", nil, `{"deduplication": {"id": "d"}}`), false, "does not deduplicate"},
		{"unknown", goldenJob(1, "a", `[]`, "q", nil, `{"atempts": 3}`), false, `"atempts", which the bullmq target does not map`},
		{"float priority", goldenJob(1, "a", `[]`, "q", nil, `{"priority": 1.5}`), false, "between 0 and 2097151"},
		{"priority over the limit", goldenJob(1, "a", `[]`, "q", nil, `{"priority": 2097152}`), false, "between 0 and 2097151"},
		{"jitter", goldenJob(1, "a", `[]`, "q", nil, `{"backoff": {"type": "fixed", "delay": 1, "jitter": 2}}`), false, "jitter should be between 0 and 1"},
		{"removeOnComplete", goldenJob(1, "a", `[]`, "q", nil, `{"removeOnComplete": "yes"}`), false, "a boolean, an integer or an object"},
		{"sizeLimit", goldenJob(1, "a", `["0123456789"]`, "q", nil, `{"sizeLimit": 5}`), false, "exceeds the limit 5 bytes"},
		{"unwrapData of two", goldenJob(1, "a", `[1, 2]`, "q", nil, `{"unwrapData": true}`), false, "exactly one element"},
		{"cluster without a hash tag", goldenJob(1, "a", `[]`, "q", &later, `{}`), true, "--redis-namespace '{bull}') or the queue name ('{q}')"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var u handoff.Unit
			var res pushResult
			builtin(TargetBullMQ, targets.Options{MaxPayload: 1 << 20, Cluster: c.cluster}).add(&u, []stagedJob{c.job}, goldenNow, &res)
			if len(res.rejected) != 1 || !strings.Contains(res.rejected[0].reason, c.reason) || len(u.Ops()) != 0 {
				t.Fatalf("rejected %+v with %d ops; want the row rejected, the reason containing %q", res.rejected, len(u.Ops()), c.reason)
			}
		})
	}
	// On a cluster, a hash tag in the prefix or in the queue's name keeps a
	// job's keys in one slot.
	for _, c := range []struct{ prefix, queue string }{{"{bull}", "q"}, {"bull", "{q}"}} {
		var u handoff.Unit
		var res pushResult
		builtin(TargetBullMQ, targets.Options{Namespace: c.prefix, MaxPayload: 1 << 20, Cluster: true}).add(&u, []stagedJob{goldenJob(1, "a", `[]`, c.queue, nil, `{}`)}, goldenNow, &res)
		if len(res.rejected) != 0 || len(u.Ops()) != 1 {
			t.Errorf("prefix %s, queue %s on a cluster: rejected %+v; want the job pushed", c.prefix, c.queue, res.rejected)
		} else if u.Slot(0) < 0 {
			t.Errorf("prefix %s, queue %s: the op's keys are in several slots", c.prefix, c.queue)
		}
	}
}

// With Config.TenantKey, the schema's name goes into the job's opts under
// the key (BullMQ keeps opts it does not know: job.opts.apartment); a row
// naming another tenant there is refused.
func TestBullMQTenant(t *testing.T) {
	t.Parallel()
	tg := builtin(TargetBullMQ, targets.Options{MaxPayload: 1 << 20, Tenant: newTenantTag("apartment", "tenant_a")})
	var u handoff.Unit
	var res pushResult
	tg.add(&u, []stagedJob{goldenJob(1, "a", `[]`, "q", nil, `{}`), goldenJob(2, "a", `[]`, "q", nil, `{"apartment": "tenant_b"}`)}, goldenNow, &res)
	ops := opsOf(t, &u)
	if len(ops) != 1 || len(res.rejected) != 1 || res.rejected[0].id != 2 || !strings.Contains(res.rejected[0].reason, "tenant mismatch") {
		t.Fatalf("%d ops, rejected %+v; want job 1 pushed, job 2 refused for its tenant", len(ops), res.rejected)
	}
	if opts := ops[0].Commands[0].Args[4].(string); !strings.HasSuffix(opts, `,"apartment":"tenant_a"}`) {
		t.Fatalf("opts %s, want the tenant under apartment", opts)
	}
}
