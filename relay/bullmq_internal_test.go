package relay

import (
	"strings"
	"testing"
	"time"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	targets "github.com/stagedrain/stagedrain/relay/internal/target"
)

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
