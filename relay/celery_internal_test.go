package relay

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// A priority maps to the list Kombu's _q_for_pri gives it, with the
// default priority_steps [0, 3, 6, 9].
func TestCeleryListForPriority(t *testing.T) {
	t.Parallel()
	want := []string{"q", "q", "q", "q\x06\x163", "q\x06\x163", "q\x06\x163", "q\x06\x166", "q\x06\x166", "q\x06\x166", "q\x06\x169"}
	for p, w := range want {
		if got := newCeleryKeys("").list("q", p); got != w {
			t.Errorf("priority %d: list %q, want %q", p, got, w)
		}
	}
	if got := newCeleryKeys("ns").list("q", 9); got != "ns:q\x06\x169" {
		t.Errorf("namespaced priority 9: list %q, want %q", got, "ns:q\x06\x169")
	}
}

// Options map onto the task message, or make the row poison with a reason
// that says what is wrong.
func TestCeleryMessageOptions(t *testing.T) {
	t.Parallel()
	created := time.Date(2026, 11, 29, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		options string
		reason  string                  // "" valid
		check   func(celeryMessage) any // for a valid row: nil, or what is wrong
	}{
		{`{}`, "", func(m celeryMessage) any { return ifNot(string(m.kwargs) == "{}" && m.priority == 0, m) }},
		{`{"kwargs": {"a": 1}}`, "", func(m celeryMessage) any { return ifNot(string(m.kwargs) == `{"a": 1}`, m.kwargs) }},
		{`{"kwargs": [1]}`, `options "kwargs" must be a JSON object`, nil},
		{`{"kwargs": null}`, `options "kwargs" must be a JSON object`, nil},
		{`{"priority": 9}`, "", func(m celeryMessage) any { return ifNot(m.priority == 9, m.priority) }},
		{`{"priority": 10}`, `options "priority" must be an integer from 0 to 9`, nil},
		{`{"priority": "high"}`, `options "priority" must be an integer from 0 to 9`, nil},
		{`{"expires": 90.5}`, "", func(m celeryMessage) any { return ifNot(m.expires == "2026-11-29T12:01:30.500000+00:00", m.expires) }},
		{`{"expires": "2026-11-29T13:00:00+01:00"}`, "", func(m celeryMessage) any { return ifNot(m.expires == "2026-11-29T12:00:00+00:00", m.expires) }},
		{`{"expires": "tomorrow"}`, `options "expires" must be seconds after created_at or an ISO 8601 time`, nil},
		{`{"expires": -1}`, `options "expires" must be seconds after created_at`, nil},
		{`{"retries": 2}`, "", func(m celeryMessage) any { return ifNot(m.retries == 2, m.retries) }},
		{`{"retries": -1}`, `options "retries" must be an integer of at least 0`, nil},
		{`{"time_limit": 30, "soft_time_limit": 25.5}`, "", func(m celeryMessage) any {
			return ifNot(string(m.hard) == "30" && string(m.soft) == "25.5", [2]string{string(m.hard), string(m.soft)})
		}},
		{`{"time_limit": 0}`, `options "time_limit" must be a number of seconds above 0`, nil},
		{`{"shadow": 7}`, `options "shadow" must be a string`, nil},
		{`{"ignore_result": "yes"}`, `options "ignore_result" must be true or false`, nil},
		{`{"headers": {"request_id": "r-1"}}`, "", func(m celeryMessage) any {
			return ifNot(len(m.headers) == 1 && m.headers[0].key == "request_id", m.headers)
		}},
		{`{"headers": {"task": "other"}}`, `options "headers" sets "task", a header of Celery's task protocol`, nil},
		{`{"headers": {"traceparent": "x"}}`, `stage the trace context as the option "traceparent"`, nil},
		{`{"headers": [1]}`, `options "headers" must be a JSON object of custom headers`, nil},
		{`{"eta": "2026-11-30T00:00:00Z"}`, `options sets "eta": stage the time in run_at`, nil},
		{`{"countdown": 10}`, `options sets "countdown": stage the time in run_at`, nil},
		{`{"link": {}}`, `options sets "link", which the celery target has no mapping for`, nil},
		{`{"queue": "x"}`, `options sets "queue", which comes from a column`, nil},
		{`{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "tracestate": "a=b"}`, "", func(m celeryMessage) any {
			return ifNot(len(m.headers) == 2 && m.headers[0].key == "traceparent" && m.headers[1].key == "tracestate", m.headers)
		}},
		{`{"traceparent": "00-zz-01"}`, "", func(m celeryMessage) any { return ifNot(len(m.headers) == 0, m.headers) }},
	} {
		j := stagedJob{id: 1, name: "tasks.t", args: []byte(`[1]`), queue: "celery", jid: "j1", createdAt: created, options: []byte(tc.options)}
		m, err := newCeleryMessage(&j, tenantTag{})
		switch {
		case tc.reason != "" && (err == nil || !strings.Contains(err.Error(), tc.reason)):
			t.Errorf("options %s: error %v, want one containing %q", tc.options, err, tc.reason)
		case tc.reason == "" && err != nil:
			t.Errorf("options %s: %v, want valid", tc.options, err)
		case tc.reason == "":
			if bad := tc.check(m); bad != nil {
				t.Errorf("options %s: got %v", tc.options, bad)
			}
			// The message is JSON, whatever the options.
			b := m.appendJSON(nil, &j, "00000000-0000-4000-8000-000000000001")
			if !json.Valid(b) {
				t.Errorf("options %s: the message is not JSON: %s", tc.options, b)
			}
		}
	}
}

func ifNot(ok bool, seen any) any {
	if ok {
		return nil
	}
	return seen
}

// The tenant goes as a header; options naming another tenant, directly or
// in their headers, make the row poison.
func TestCeleryTenantHeader(t *testing.T) {
	t.Parallel()
	tenant := newTenantTag("apartment", "acme")
	for _, tc := range []struct{ options, reason string }{
		{`{}`, ""},
		{`{"apartment": "acme"}`, ""},
		{`{"headers": {"apartment": "acme"}}`, ""},
		{`{"apartment": "other"}`, "tenant mismatch"},
		{`{"headers": {"apartment": "other"}}`, "tenant mismatch"},
	} {
		j := stagedJob{id: 1, name: "t", args: []byte(`[]`), queue: "celery", jid: "j", options: []byte(tc.options)}
		m, err := newCeleryMessage(&j, tenant)
		if tc.reason != "" {
			if err == nil || !strings.Contains(err.Error(), tc.reason) {
				t.Errorf("options %s: %v, want %q", tc.options, err, tc.reason)
			}
			continue
		}
		if err != nil || len(m.headers) != 1 || m.headers[0].key != "apartment" || string(m.headers[0].value) != `"acme"` {
			t.Errorf("options %s: headers %v, err %v; want apartment \"acme\" once", tc.options, m.headers, err)
		}
	}
}

// Validate refuses the celery target on a Redis Cluster client, and
// --timestamp-format millis with it.
func TestValidateCelery(t *testing.T) {
	t.Parallel()
	base := Config{DatabaseURL: "postgres://127.0.0.1/test", Redis: redis.NewClient(&redis.Options{}), Target: TargetCelery}.WithDefaults()
	cluster := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}})
	t.Cleanup(func() { _ = base.Redis.Close(); _ = cluster.Close() })
	for _, tc := range []struct {
		name  string
		edit  func(*Config)
		field string
	}{
		{"plain", func(*Config) {}, ""},
		{"namespace", func(c *Config) { c.RedisNamespace = "myapp" }, ""},
		{"cluster", func(c *Config) { c.Redis = cluster }, "Redis"},
		{"millis", func(c *Config) { c.TimestampFormat = TimestampMillis }, "TimestampFormat"},
		{"tenant key a header", func(c *Config) { c.TenantKey = "root_id" }, "TenantKey"},
	} {
		c := base
		tc.edit(&c)
		err := c.Validate()
		var fe *FieldError
		switch {
		case tc.field == "" && err != nil:
			t.Errorf("%s: %v, want valid", tc.name, err)
		case tc.field != "" && (!errors.As(err, &fe) || fe.Field != tc.field):
			t.Errorf("%s: %v, want a FieldError on %s", tc.name, err, tc.field)
		}
	}
}
