package relay

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay/internal/handoff"
	targets "github.com/stagedrain/stagedrain/relay/internal/target"
)

// The golden file of Config.TenantKey for the gem's rows, as the relay
// reads them (the targets' tenant goldens are in relay/internal/target).
func TestGoldenTenantStagedPush(t *testing.T) {
	t.Parallel()
	const key, schema = "apartment", "tenant_1"
	tag := newTenantTag(key, schema)

	gem := []string{
		`{"class":"WelcomeJob","args":[42],"jid":"` + goldenJID + `"}`,
		`{"class":"ReceiptJob","args":[7],"jid":"0123456789abcdef01234502","apartment":"tenant_1"}`,
	}
	var jobs []stagedJob
	for i, p := range gem {
		epoch := float64(goldenCreated.UnixMicro()) / 1e6
		j := stagedJob{id: int64(i + 1)}
		mapStagedPush(&j, []byte(p), &epoch, goldenNow)
		jobs = append(jobs, j)
	}
	g := builtin(TargetSidekiq, targets.Options{MaxPayload: 1 << 20, Tenant: tag})
	checkGolden(t, "sidekiq_staged_push_tenant.json", goldenFile{
		Case:   "Rows of sidekiq_staged_push_jobs (payload: the whole Sidekiq job hash) with --tenant-key apartment in schema tenant_1: a payload's own apartment key is an option like any other; the job hash gets the schema's name once",
		Target: "sidekiq", Timestamps: string(TimestampSeconds), TenantKey: key, Schema: schema, Now: goldenNow,
		Source: map[string]any{"payloads": payloadsJSON(gem)}, Rows: rowsOf(jobs), Ops: build(t, g, jobs)})
}

func payloadsJSON(texts []string) []json.RawMessage {
	out := make([]json.RawMessage, len(texts))
	for i, s := range texts {
		out[i] = json.RawMessage(s)
	}
	return out
}

// Each target rejects a row whose options name another tenant, with a
// reason naming both, and passes one naming its own schema; with the key
// off, the same options are an ordinary option (asynq: an unknown one).
func TestTenantRule(t *testing.T) {
	t.Parallel()
	tag := newTenantTag("apartment", "tenant_1")
	now := goldenNow
	targets := map[string]func(tenantTag) target{
		"sidekiq": func(tg tenantTag) target {
			return builtin(TargetSidekiq, targets.Options{MaxPayload: 1 << 20, Tenant: tg})
		},
		"asynq": func(tg tenantTag) target {
			return builtin(TargetAsynq, targets.Options{MaxPayload: 1 << 20, Tenant: tg})
		},
		"streams": func(tg tenantTag) target {
			return builtin(TargetStreams, targets.Options{MaxPayload: 1 << 20, Tenant: tg})
		},
	}
	for _, c := range []struct {
		options string
		reason  string // "" passes
		only    string // the target the case is for; "" all
	}{
		{`{}`, "", ""},
		{`{"apartment": "tenant_1"}`, "", ""},
		{`{"apartment": "tenant_2"}`, `tenant mismatch: the job names tenant "tenant_2" under "apartment", but it was staged in schema "tenant_1"`, ""},
		{`{"apartment": "Tenant_1"}`, `names tenant "Tenant_1"`, ""},
		{`{"apartment": null}`, `tenant mismatch: the job sets "apartment" to null, not to the name of the schema it was staged in, "tenant_1"`, ""},
		{`{"apartment": ["tenant_1"]}`, `sets "apartment" to ["tenant_1"]`, ""},
		{`{"headers": {"apartment": "tenant_2"}}`, `tenant mismatch: the job's headers name tenant "tenant_2" under "apartment", but it was staged in schema "tenant_1"`, "asynq"},
		{`{"headers": {"apartment": "tenant_1"}}`, "", "asynq"},
	} {
		for name, newTarget := range targets {
			if c.only != "" && c.only != name {
				continue
			}
			var u handoff.Unit
			var res pushResult
			newTarget(tag).add(&u, []stagedJob{goldenJob(1, "J", `[1]`, "default", nil, c.options)}, now, &res)
			var got string
			if len(res.rejected) > 0 {
				got = res.rejected[0].reason
			}
			if (c.reason == "") != (got == "") || !strings.Contains(got, c.reason) {
				t.Errorf("%s, options %s: rejected %q, want %q", name, c.options, got, c.reason)
			}
		}
	}
	// Off, the key is nobody's: Sidekiq and streams carry it as an option.
	for _, name := range []string{"sidekiq", "streams"} {
		var u handoff.Unit
		var res pushResult
		targets[name](tenantTag{}).add(&u, []stagedJob{goldenJob(1, "J", `[1]`, "default", nil, `{"apartment": "tenant_2"}`)}, now, &res)
		if len(res.rejected) > 0 {
			t.Errorf("%s without a tenant key rejected %v", name, res.rejected)
		}
	}
}

// TenantKey may not be a key the target's format owns, nor blank-edged or
// hold control characters; the line names the key and what it collides
// with.
func TestValidateTenantKey(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		target Target
		key    string
		want   string // "" valid
	}{
		{TargetSidekiq, "", ""},
		{TargetSidekiq, "apartment", ""},
		{TargetSidekiq, "tenant", ""},
		{TargetAsynq, "apartment", ""},
		{TargetStreams, "apartment", ""},
		{TargetSidekiq, "class", `"class" is a key the sidekiq target's format owns (class, args,`},
		{TargetSidekiq, "retry", `"retry" is a key the sidekiq target's format owns`},
		{TargetSidekiq, "enqueued_at", "owns"},
		{TargetSidekiq, "wrapped", "owns"},
		{TargetSidekiq, "traceparent", "owns"},
		{TargetAsynq, "headers", `"headers" is a key the asynq target's format owns`},
		{TargetAsynq, "retry", "owns"},
		{TargetAsynq, "tracestate", "owns"},
		{TargetAsynq, "class", ""}, // asynq has no such key
		{TargetStreams, "options", `"options" is a key the streams target's format owns`},
		{TargetStreams, "jid", "owns"},
		{TargetStreams, "retry", ""}, // an entry has no such field
		{TargetSidekiq, " apartment", "without control characters or surrounding spaces"},
		{TargetSidekiq, "apart\nment", "without control characters"},
	} {
		cfg := Config{DatabaseURL: "postgres://localhost/db", Redis: (*redis.Client)(nil), Target: c.target, TenantKey: c.key}.WithDefaults()
		err := cfg.Validate()
		var fe *FieldError
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%s, TenantKey %q: %v, want valid", c.target, c.key, err)
		case c.want != "" && (!errors.As(err, &fe) || fe.Field != "TenantKey" || !strings.Contains(fe.Reason, c.want) || strings.Contains(fe.Reason, "\n")):
			t.Errorf("%s, TenantKey %q: %v, want one line on TenantKey containing %q", c.target, c.key, err, c.want)
		}
	}
}
