package target

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

// Options asynq has no place for, or values it would refuse, make the row
// poison with a reason; the mapping of the others is checked above.
func TestAsynqTaskOptions(t *testing.T) {
	t.Parallel()
	tests := []struct {
		options string
		want    string // "" for accepted
	}{
		{`{}`, ""},
		{`{"retry": -4}`, ""}, // asynq's MaxRetry: below 0 means 0
		{`{"retry": true}`, ""},
		{`{"deadline": "2030-01-02T03:04:05Z"}`, ""},
		{`{"retry": "5"}`, `options "retry" must be an integer`},
		{`{"timeout": 1.5}`, `options "timeout" must be an integer of at least 0`},
		{`{"unique": 0}`, `options "unique" must be an integer of at least 1`},
		{`{"deadline": "tomorrow"}`, `options "deadline" must be integer epoch seconds or RFC 3339 text`},
		{`{"headers": {"a": 1}}`, `options "headers" must be an object of strings`},
		{`{"headers": null}`, `options "headers" must be an object of strings`},
		{`{"tags": ["x"]}`, `options sets "tags", which asynq has no task option for`},
		{`{"jid": "x"}`, `options sets "jid", which comes from a column`},
		{`[]`, `options is not a JSON object`},
	}
	for _, tt := range tests {
		j := Job{ID: 1, Name: "N", Args: []byte("[]"), Queue: "q", JID: "j", Options: []byte(tt.options)}
		task, err := newAsynqTask(&j, Tenant{})
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("options %s: %v, want accepted", tt.options, err)
		case tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)):
			t.Errorf("options %s: error %v, want one containing %q", tt.options, err, tt.want)
		}
		if tt.options == `{"retry": -4}` && task.msg.retry != 0 {
			t.Errorf("retry -4 became %d, want 0", task.msg.retry)
		}
		if tt.options == `{"retry": true}` && task.msg.retry != asynqDefaultRetry {
			t.Errorf("retry true became %d, want %d", task.msg.retry, asynqDefaultRetry)
		}
		if tt.options == `{"deadline": "2030-01-02T03:04:05Z"}` && (task.msg.deadline != 1893553445 || task.msg.timeout != 0) {
			t.Errorf("deadline text became deadline %d timeout %d, want 1893553445 and 0", task.msg.deadline, task.msg.timeout)
		}
	}
	for _, j := range []Job{
		{Name: " ", Args: []byte("[]"), Queue: "q", JID: "j", Options: []byte("{}")},
		{Name: "N", Args: []byte("[]"), Queue: "\t", JID: "j", Options: []byte("{}")},
		{Name: "N", Args: []byte("[]"), Queue: "q", JID: " ", Options: []byte("{}")},
		{Name: "N", Args: []byte(`{"a": 1}`), Queue: "q", JID: "j", Options: []byte("{}")},
	} {
		if _, err := newAsynqTask(&j, Tenant{}); err == nil {
			t.Errorf("job %+v accepted, want refused", j)
		}
	}
}

// JavaScript's `${parseInt(s, 10)}` === s, as BullMQ tests a custom id.
func TestJSInteger(t *testing.T) {
	t.Parallel()
	for s, want := range map[string]bool{
		"42": true, "-7": true, "0": true, "9007199254740993": false, "12345678901234567000": true,
		"007": false, "-0": false, "1e3": false, "4.2": false, "": false, "123456789012345678901234": false,
		"0123456789abcdef01234567": false,
	} {
		if got := jsInteger(s); got != want {
			t.Errorf("jsInteger(%q) = %v, want %v", s, got, want)
		}
	}
}

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
		j := Job{ID: 1, Name: "tasks.t", Args: []byte(`[1]`), Queue: "celery", JID: "j1", CreatedAt: created, Options: []byte(tc.options)}
		m, err := newCeleryMessage(&j, Tenant{})
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
	tenant := NewTenant("apartment", "acme")
	for _, tc := range []struct{ options, reason string }{
		{`{}`, ""},
		{`{"apartment": "acme"}`, ""},
		{`{"headers": {"apartment": "acme"}}`, ""},
		{`{"apartment": "other"}`, "tenant mismatch"},
		{`{"headers": {"apartment": "other"}}`, "tenant mismatch"},
	} {
		j := Job{ID: 1, Name: "t", Args: []byte(`[]`), Queue: "celery", JID: "j", Options: []byte(tc.options)}
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

func TestAppendSidekiqPayload(t *testing.T) {
	created := time.Date(2026, 11, 29, 12, 0, 0, 500_000_000, time.UTC)
	now := created.Add(2 * time.Second)
	later := now.Add(time.Hour)
	earlier := now.Add(-time.Hour)
	base := Job{ID: 1, Name: "HardJob", Args: []byte(`[1, "two", {"three": 3}]`), Queue: "default",
		JID: "0123456789abcdef01234567", CreatedAt: created, Options: []byte(`{}`)}
	with := func(f func(*Job)) Job { j := base; f(&j); return j }

	tests := []struct {
		name   string
		job    Job
		millis bool
		want   string
	}{
		{"immediate, seconds", base, false,
			`{"class":"HardJob","args":[1, "two", {"three": 3}],"queue":"default","jid":"0123456789abcdef01234567","retry":true,"created_at":1795953600.5,"enqueued_at":1795953602.5}`},
		{"immediate, millis", base, true,
			`{"class":"HardJob","args":[1, "two", {"three": 3}],"queue":"default","jid":"0123456789abcdef01234567","retry":true,"created_at":1795953600500,"enqueued_at":1795953602500}`},
		{"whole seconds keep a decimal point", with(func(j *Job) { j.CreatedAt = created.Truncate(time.Second) }), false,
			`{"class":"HardJob","args":[1, "two", {"three": 3}],"queue":"default","jid":"0123456789abcdef01234567","retry":true,"created_at":1795953600.0,"enqueued_at":1795953602.5}`},
		{"scheduled has no enqueued_at", with(func(j *Job) { j.RunAt = &later }), false,
			`{"class":"HardJob","args":[1, "two", {"three": 3}],"queue":"default","jid":"0123456789abcdef01234567","retry":true,"created_at":1795953600.5}`},
		{"run_at in the past runs now", with(func(j *Job) { j.RunAt = &earlier }), false,
			`{"class":"HardJob","args":[1, "two", {"three": 3}],"queue":"default","jid":"0123456789abcdef01234567","retry":true,"created_at":1795953600.5,"enqueued_at":1795953602.5}`},
		{"options merged, retry overridden", with(func(j *Job) { j.Options = []byte(`{"tags": ["a"], "retry": false, "backtrace": 5}`) }), false,
			`{"class":"HardJob","args":[1, "two", {"three": 3}],"queue":"default","jid":"0123456789abcdef01234567","created_at":1795953600.5,"enqueued_at":1795953602.5,"backtrace":5,"retry":false,"tags":["a"]}`},
		{"strings escaped", with(func(j *Job) { j.Name = "A\"B\\C\n\x01é"; j.Queue = "q\t1" }), true,
			`{"class":"A\"B\\C\n\u0001é","args":[1, "two", {"three": 3}],"queue":"q\t1","jid":"0123456789abcdef01234567","retry":true,"created_at":1795953600500,"enqueued_at":1795953602500}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := appendSidekiqPayload(nil, &tc.job, now, tc.millis, Tenant{})
			if err != nil {
				t.Fatal(err)
			}
			if string(got) != tc.want {
				t.Fatalf("payload\n got %s\nwant %s", got, tc.want)
			}
			if !json.Valid(got) {
				t.Fatalf("payload is not valid JSON: %s", got)
			}
		})
	}
}

func TestAppendSidekiqPayloadRejects(t *testing.T) {
	now := time.Now()
	ok := Job{Name: "J", Args: []byte(`[]`), Queue: "q", JID: "j", Options: []byte(`{}`)}
	tests := []struct {
		name   string
		mutate func(*Job)
		reason string
	}{
		{"empty name", func(j *Job) { j.Name = "" }, "job_name is empty"},
		{"empty queue", func(j *Job) { j.Queue = "" }, "queue is empty"},
		{"args object", func(j *Job) { j.Args = []byte(`{"a":1}`) }, "job_args is not a JSON array"},
		{"options array", func(j *Job) { j.Options = []byte(`[1]`) }, "options is not a JSON object"},
		{"options reserved key", func(j *Job) { j.Options = []byte(`{"jid":"x"}`) }, `options sets "jid"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			j := ok
			tc.mutate(&j)
			prefix := []byte("keep")
			got, err := appendSidekiqPayload(prefix, &j, now, false, Tenant{})
			if err == nil || !strings.Contains(err.Error(), tc.reason) {
				t.Fatalf("error = %v, want one containing %q", err, tc.reason)
			}
			if string(got) != "keep" {
				t.Fatalf("buffer = %q after a rejected row, want it unchanged", got)
			}
		})
	}
}

func FuzzAppendJSONString(f *testing.F) {
	for _, s := range []string{"", "plain", "quote\"back\\slash", "ctl\x00\x1f\x7f", "é日本\u2028", "\xff\xfe bad utf8"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		b := AppendJSONString(nil, s)
		var back string
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatalf("AppendJSONString(%q) = %s: not a JSON string: %v", s, b, err)
		}
		want := string([]rune(s)) // each invalid byte becomes U+FFFD
		if utf8.ValidString(s) && want != s {
			t.Fatalf("[]rune conversion changed valid %q", s)
		}
		if back != want {
			t.Fatalf("round trip of %q gave %q, want %q", s, back, want)
		}
	})
}

// BenchmarkSidekiqPayload measures building one job's payload into a reused
// buffer: it should not allocate.
func BenchmarkSidekiqPayload(b *testing.B) {
	now := time.Now()
	j := Job{ID: 1, Name: "WelcomeEmailJob", Args: []byte(`[42, "welcome", {"locale": "en"}]`), Queue: "default",
		JID: "0123456789abcdef01234567", CreatedAt: now, Options: []byte(`{}`)}
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		var err error
		buf, err = appendSidekiqPayload(buf[:0], &j, now, false, Tenant{})
		if err != nil {
			b.Fatal(err)
		}
	}
}

// appendTimestamp writes the same number as the float Sidekiq would.
func TestAppendfalse(t *testing.T) {
	for _, us := range []int64{0, 1, 999_999, 1_000_000, 1795953600_500000, 1795953600_000001, 1795953600_123450, -1, -1_500_000} {
		tm := time.UnixMicro(us)
		got := string(appendTimestamp(nil, tm, false))
		var f float64
		if err := json.Unmarshal([]byte(got), &f); err != nil || !strings.Contains(got, ".") {
			t.Fatalf("appendTimestamp(%d µs) = %q: want a JSON number with a decimal point", us, got)
		}
		if want := float64(us) / 1e6; f != want {
			t.Fatalf("appendTimestamp(%d µs) = %q = %v, want %v", us, got, f, want)
		}
	}
}

func TestValidTraceparent(t *testing.T) {
	for s, want := range map[string]bool{
		"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01":       true,
		"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra": true,
		"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra": false, // 00 is exactly 55
		"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01":       false,
		"00-00000000000000000000000000000000-b7ad6b7169203331-01":       false,
		"00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01":       false,
		"00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01":       false,
		"00-0af7651916cd43dd8448eb211c80319c_b7ad6b7169203331-01":       false,
		"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0g":       false,
		"":                  false,
		"00-zzzz-01":        false,
		"not a traceparent": false,
	} {
		if got := ValidTraceparent(s); got != want {
			t.Errorf("ValidTraceparent(%q) = %v, want %v", s, got, want)
		}
	}
}
