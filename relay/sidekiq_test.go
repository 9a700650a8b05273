package relay

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

func TestAppendSidekiqPayload(t *testing.T) {
	created := time.Date(2026, 11, 29, 12, 0, 0, 500_000_000, time.UTC)
	now := created.Add(2 * time.Second)
	later := now.Add(time.Hour)
	earlier := now.Add(-time.Hour)
	base := stagedJob{id: 1, name: "HardJob", args: []byte(`[1, "two", {"three": 3}]`), queue: "default",
		jid: "0123456789abcdef01234567", createdAt: created, options: []byte(`{}`)}
	with := func(f func(*stagedJob)) stagedJob { j := base; f(&j); return j }

	tests := []struct {
		name string
		job  stagedJob
		ts   TimestampFormat
		want string
	}{
		{"immediate, seconds", base, TimestampSeconds,
			`{"class":"HardJob","args":[1, "two", {"three": 3}],"queue":"default","jid":"0123456789abcdef01234567","retry":true,"created_at":1795953600.5,"enqueued_at":1795953602.5}`},
		{"immediate, millis", base, TimestampMillis,
			`{"class":"HardJob","args":[1, "two", {"three": 3}],"queue":"default","jid":"0123456789abcdef01234567","retry":true,"created_at":1795953600500,"enqueued_at":1795953602500}`},
		{"whole seconds keep a decimal point", with(func(j *stagedJob) { j.createdAt = created.Truncate(time.Second) }), TimestampSeconds,
			`{"class":"HardJob","args":[1, "two", {"three": 3}],"queue":"default","jid":"0123456789abcdef01234567","retry":true,"created_at":1795953600.0,"enqueued_at":1795953602.5}`},
		{"scheduled has no enqueued_at", with(func(j *stagedJob) { j.runAt = &later }), TimestampSeconds,
			`{"class":"HardJob","args":[1, "two", {"three": 3}],"queue":"default","jid":"0123456789abcdef01234567","retry":true,"created_at":1795953600.5}`},
		{"run_at in the past runs now", with(func(j *stagedJob) { j.runAt = &earlier }), TimestampSeconds,
			`{"class":"HardJob","args":[1, "two", {"three": 3}],"queue":"default","jid":"0123456789abcdef01234567","retry":true,"created_at":1795953600.5,"enqueued_at":1795953602.5}`},
		{"options merged, retry overridden", with(func(j *stagedJob) { j.options = []byte(`{"tags": ["a"], "retry": false, "backtrace": 5}`) }), TimestampSeconds,
			`{"class":"HardJob","args":[1, "two", {"three": 3}],"queue":"default","jid":"0123456789abcdef01234567","created_at":1795953600.5,"enqueued_at":1795953602.5,"backtrace":5,"retry":false,"tags":["a"]}`},
		{"strings escaped", with(func(j *stagedJob) { j.name = "A\"B\\C\n\x01é"; j.queue = "q\t1" }), TimestampMillis,
			`{"class":"A\"B\\C\n\u0001é","args":[1, "two", {"three": 3}],"queue":"q\t1","jid":"0123456789abcdef01234567","retry":true,"created_at":1795953600500,"enqueued_at":1795953602500}`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := appendSidekiqPayload(nil, &tc.job, now, tc.ts, tenantTag{})
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
	ok := stagedJob{name: "J", args: []byte(`[]`), queue: "q", jid: "j", options: []byte(`{}`)}
	tests := []struct {
		name   string
		mutate func(*stagedJob)
		reason string
	}{
		{"empty name", func(j *stagedJob) { j.name = "" }, "job_name is empty"},
		{"empty queue", func(j *stagedJob) { j.queue = "" }, "queue is empty"},
		{"args object", func(j *stagedJob) { j.args = []byte(`{"a":1}`) }, "job_args is not a JSON array"},
		{"options array", func(j *stagedJob) { j.options = []byte(`[1]`) }, "options is not a JSON object"},
		{"options reserved key", func(j *stagedJob) { j.options = []byte(`{"jid":"x"}`) }, `options sets "jid"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			j := ok
			tc.mutate(&j)
			prefix := []byte("keep")
			got, err := appendSidekiqPayload(prefix, &j, now, TimestampSeconds, tenantTag{})
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
		b := appendJSONString(nil, s)
		var back string
		if err := json.Unmarshal(b, &back); err != nil {
			t.Fatalf("appendJSONString(%q) = %s: not a JSON string: %v", s, b, err)
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

func TestChannelName(t *testing.T) {
	if got := ChannelName("public"); got != "stagedrain_public" {
		t.Fatalf("ChannelName(public) = %q", got)
	}
	long := strings.Repeat("s", 63)
	if got := ChannelName(long); len(got) > 63 || got == ChannelName(long[:62]) {
		t.Fatalf("ChannelName(63 bytes) = %q: want at most 63 bytes, distinct from a shorter schema's", got)
	}
}

func TestBackoff(t *testing.T) {
	max := 2 * time.Second
	prevMax := time.Duration(0)
	for attempt := 1; attempt <= 10; attempt++ {
		d := backoff(attempt, max)
		nominal := min(minBackoff<<(attempt-1), max)
		if d < nominal*3/4 || d > nominal {
			t.Fatalf("backoff(%d) = %s, want between 75%% of %s and %s", attempt, d, nominal, nominal)
		}
		prevMax = nominal
	}
	if prevMax != max {
		t.Fatalf("backoff never reached the cap %s", max)
	}
}

// Jitter never takes a wait above the cap, whatever the cap and attempt.
func TestBackoffNeverAboveMax(t *testing.T) {
	for _, max := range []time.Duration{minBackoff, 150 * time.Millisecond, 500 * time.Millisecond, 5 * time.Second, time.Minute} {
		for attempt := 1; attempt <= 64; attempt++ {
			for range 200 {
				if d := backoff(attempt, max); d > max || d < max/2 && attempt > 20 {
					t.Fatalf("backoff(%d, %s) = %s, want at most %s (and near it once capped)", attempt, max, d, max)
				}
			}
		}
	}
}

// BenchmarkSidekiqPayload measures building one job's payload into a reused
// buffer: it should not allocate.
func BenchmarkSidekiqPayload(b *testing.B) {
	now := time.Now()
	j := stagedJob{id: 1, name: "WelcomeEmailJob", args: []byte(`[42, "welcome", {"locale": "en"}]`), queue: "default",
		jid: "0123456789abcdef01234567", createdAt: now, options: []byte(`{}`)}
	var buf []byte
	b.ReportAllocs()
	for b.Loop() {
		var err error
		buf, err = appendSidekiqPayload(buf[:0], &j, now, TimestampSeconds, tenantTag{})
		if err != nil {
			b.Fatal(err)
		}
	}
}

// appendTimestamp writes the same number as the float Sidekiq would.
func TestAppendTimestampSeconds(t *testing.T) {
	for _, us := range []int64{0, 1, 999_999, 1_000_000, 1795953600_500000, 1795953600_000001, 1795953600_123450, -1, -1_500_000} {
		tm := time.UnixMicro(us)
		got := string(appendTimestamp(nil, tm, TimestampSeconds))
		var f float64
		if err := json.Unmarshal([]byte(got), &f); err != nil || !strings.Contains(got, ".") {
			t.Fatalf("appendTimestamp(%d µs) = %q: want a JSON number with a decimal point", us, got)
		}
		if want := float64(us) / 1e6; f != want {
			t.Fatalf("appendTimestamp(%d µs) = %q = %v, want %v", us, got, f, want)
		}
	}
}
