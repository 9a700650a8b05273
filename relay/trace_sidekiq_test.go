package relay_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// tracedJob is what testdata/trace_worker.rb's middleware printed of a job.
type tracedJob struct {
	JID         string  `json:"jid"`
	Traceparent *string `json:"traceparent"`
	Tracestate  *string `json:"tracestate"`
}

// startTraceWorker starts a real Sidekiq on testdata/trace_worker.rb,
// reading redisURL.
func startTraceWorker(t *testing.T, redisURL string) *testenv.Sidekiq {
	t.Helper()
	return testenv.StartSidekiq(t, "testdata/trace_worker.rb", redisURL)
}

func tracedJobs(t *testing.T, out string) map[string]tracedJob {
	got := map[string]tracedJob{}
	for _, line := range strings.Split(out, "\n") {
		_, js, ok := strings.Cut(line, "traced ")
		if !ok {
			continue
		}
		var j tracedJob
		if err := json.Unmarshal([]byte(js), &j); err != nil {
			t.Fatalf("worker line %q: %v", line, err)
		}
		got[j.JID] = j
	}
	return got
}

// A real Sidekiq's server middleware finds, in job['traceparent'], the
// traceparent the app staged: from Go's Stage in a span, immediate and
// scheduled (run by Sidekiq's own poller of the schedule), and from one
// line of SQL, as a Ruby or Python app writes it, with its tracestate. A
// malformed one is dropped and the job runs without it.
func TestTraceSidekiqJobHashCarriesTraceparent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	h := newHarness(t)
	srv := testenv.StartRedis(t)
	opts, _ := redis.ParseURL(srv.URL())
	rdb := redis.NewClient(testenv.RedisOptions(opts))
	t.Cleanup(func() { _ = rdb.Close() })
	_, tp := recorder(t)
	cfg := h.config()
	cfg.Redis, cfg.RedisNamespace, cfg.TracerProvider = rdb, "", tp
	out := startTraceWorker(t, srv.URL())
	h.start(cfg)

	app, jids := stageInSpan(t, h, tp, relay.Job{Name: "TracedJob", Args: []any{1}},
		relay.Job{Name: "TracedJob", Args: []any{2}, RunAt: time.Now().Add(2 * time.Second)})
	want := fmt.Sprintf("00-%s-%s-01", app.TraceID(), app.SpanID())

	// The SQL an app without the Go stager runs, its tracer's values bound.
	const sqlTP, sqlTS = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", "rojo=00f067aa0ba902b7"
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	var sqlJID, badJID string
	if err := h.conn.QueryRow(ctx, `INSERT INTO `+table+` (job_name, job_args, options)
		VALUES ('TracedJob', '[3]', jsonb_build_object('traceparent', $1::text, 'tracestate', $2::text)) RETURNING jid`,
		sqlTP, sqlTS).Scan(&sqlJID); err != nil {
		t.Fatal(err)
	}
	if err := h.conn.QueryRow(ctx, `INSERT INTO `+table+` (job_name, job_args, options)
		VALUES ('TracedJob', '[4]', '{"traceparent": "00-zzzz-01", "tracestate": "a=b", "retry": 1}') RETURNING jid`).Scan(&badJID); err != nil {
		t.Fatal(err)
	}

	var got map[string]tracedJob
	testenv.WaitFor(t, 30*time.Second, "Sidekiq to run the 4 jobs, the scheduled one too", func() (bool, string) {
		got = tracedJobs(t, out.String())
		return len(got) == 4, fmt.Sprintf("ran %v; worker output:\n%s\nrelay logs: %v", got, out.String(), messages(h.logs))
	})
	str := func(p *string) string {
		if p == nil {
			return "<none>"
		}
		return *p
	}
	for _, c := range []struct{ jid, tp, ts string }{
		{jids[0], want, "<none>"}, {jids[1], want, "<none>"}, {sqlJID, sqlTP, sqlTS}, {badJID, "<none>", "<none>"},
	} {
		j := got[c.jid]
		if str(j.Traceparent) != c.tp || str(j.Tracestate) != c.ts {
			t.Errorf("job %s: the worker saw traceparent %s, tracestate %s; want %s, %s",
				c.jid, str(j.Traceparent), str(j.Tracestate), c.tp, c.ts)
		}
	}
}
