package relay_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/redis/go-redis/v9"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// scraped is one scrape of a /metrics endpoint, parsed.
type scraped map[string]*dto.MetricFamily

// scrapeMetrics GETs url over HTTP and parses the text exposition.
func scrapeMetrics(t *testing.T, url string) scraped {
	t.Helper()
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain") {
		t.Fatalf("GET %s: %s, Content-Type %q; want 200, text/plain", url, resp.Status, resp.Header.Get("Content-Type"))
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: not the text exposition format: %v", url, err)
	}
	return fams
}

// metric finds name's sample whose labels include labels (name=value
// pairs); nil if there is none.
func (s scraped) metric(name string, labels ...string) *dto.Metric {
	f := s[name]
	if f == nil {
		return nil
	}
next:
	for _, m := range f.GetMetric() {
		for i := 0; i+1 < len(labels); i += 2 {
			found := false
			for _, lp := range m.GetLabel() {
				if lp.GetName() == labels[i] && lp.GetValue() == labels[i+1] {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		return m
	}
	return nil
}

// value is a counter's or gauge's value; -1 when the sample is missing.
func (s scraped) value(name string, labels ...string) float64 {
	m := s.metric(name, labels...)
	switch {
	case m == nil:
		return -1
	case m.Counter != nil:
		return m.Counter.GetValue()
	case m.Gauge != nil:
		return m.Gauge.GetValue()
	}
	return -1
}

// histogram is a histogram's count and sum; count -1 when it is missing.
func (s scraped) histogram(name string) (count int64, sum float64) {
	m := s.metric(name)
	if m == nil || m.Histogram == nil {
		return -1, 0
	}
	return int64(m.Histogram.GetSampleCount()), m.Histogram.GetSampleSum()
}

// waitMetric scrapes url until cond holds for the scrape, and returns it.
func waitMetric(t *testing.T, url, what string, cond func(s scraped) (bool, string)) scraped {
	t.Helper()
	var s scraped
	testenv.WaitFor(t, 20*time.Second, what, func() (bool, string) {
		s = scrapeMetrics(t, url)
		return cond(s)
	})
	return s
}

// A relay's /metrics, scraped over HTTP, follows what it does: jobs pushed
// by queue and target, batches with their sizes and durations, latency,
// dead letters, wake-ups by cause, the leader gauge; with Redis down,
// redis errors and the backlog gauges of the rows left staged; a lost lock
// connection as lost_lock. A standby in the same process has a registry
// of its own: leader 0, no backlog gauges.
func TestMetrics(t *testing.T) {
	t.Parallel()
	h := newHarness(t)
	srv := testenv.StartRedis(t)
	rdb := redis.NewClient(testenv.RedisOptions(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", srv.Port)}))
	t.Cleanup(func() { _ = rdb.Close() })
	h.rdb = rdb
	ctx := context.Background()

	cfg := h.config()
	cfg.Redis = rdb
	cfg.PollInterval = 100 * time.Millisecond
	cfg.MaxBackoff = 200 * time.Millisecond
	r, idle := h.startSignaled(cfg)
	relay.SetBacklogTTL(r, 0)
	ts := httptest.NewServer(r.MetricsHandler())
	t.Cleanup(ts.Close)
	url := ts.URL + "/metrics"
	h.waitIdleAfterListen(idle)

	s := scrapeMetrics(t, url)
	if v := s.value("stagedrain_leader"); v != 1 {
		t.Errorf("stagedrain_leader = %v, want 1 while leading", v)
	}
	if v := s.value("stagedrain_wakeups_total", "cause", "reconnect"); v < 1 {
		t.Errorf("wakeups_total{cause=reconnect} = %v, want >= 1 after the first LISTEN", v)
	}
	if b, age := s.value("stagedrain_backlog_jobs"), s.value("stagedrain_oldest_job_age_seconds"); b != 0 || age != 0 {
		t.Errorf("backlog_jobs = %v, oldest_job_age_seconds = %v with nothing staged; want 0, 0", b, age)
	}
	for _, kind := range []string{"redis", "postgres", "lost_lock"} {
		if v := s.value("stagedrain_errors_total", "kind", kind); v != 0 {
			t.Errorf("errors_total{kind=%q} = %v before any failure, want 0", kind, v)
		}
	}

	// Jobs in two queues, and one whose queue key holds a string
	// (WRONGTYPE: dead-lettered), in one transaction: the relay is idle,
	// so its commit notifies.
	if err := rdb.Set(ctx, h.key("queue:broken"), "not a list", 0).Err(); err != nil {
		t.Fatal(err)
	}
	h.stageMany(
		relay.Job{Name: "A", Queue: "alpha"}, relay.Job{Name: "A", Queue: "alpha"}, relay.Job{Name: "A", Queue: "alpha"},
		relay.Job{Name: "B", Queue: "beta"}, relay.Job{Name: "B", Queue: "beta"},
		relay.Job{Name: "X", Queue: "broken"},
	)
	h.waitStaged(0)
	h.waitQueueLen("alpha", 3, 10*time.Second)
	// A scrape is not atomic: the registry reads each metric in turn while
	// the relay counts a batch, so wait for a scrape that has all of it.
	s = waitMetric(t, url, "the batch counted and a poll wake-up", func(s scraped) (bool, string) {
		d, p := s.value("stagedrain_jobs_dead_lettered_total"), s.value("stagedrain_wakeups_total", "cause", "poll")
		b := s.value("stagedrain_batches_total")
		n, sum := s.histogram("stagedrain_batch_size")
		nd, _ := s.histogram("stagedrain_batch_duration_seconds")
		nl, _ := s.histogram("stagedrain_job_latency_seconds")
		pa, pb := s.value("stagedrain_jobs_pushed_total", "queue", "alpha", "target", "sidekiq"), s.value("stagedrain_jobs_pushed_total", "queue", "beta", "target", "sidekiq")
		return d == 1 && p >= 1 && b >= 1 && float64(n) == b && sum == 6 && float64(nd) == b && nl == 5 && pa == 3 && pb == 2,
			fmt.Sprintf("dead %v, poll wake-ups %v, batches %v, batch sizes %d summing to %v, durations %d, latencies %d, pushed %v and %v", d, p, b, n, sum, nd, nl, pa, pb)
	})
	for _, c := range []struct {
		queue string
		want  float64
	}{{"alpha", 3}, {"beta", 2}} {
		if v := s.value("stagedrain_jobs_pushed_total", "queue", c.queue, "target", "sidekiq"); v != c.want {
			t.Errorf("jobs_pushed_total{queue=%q,target=\"sidekiq\"} = %v, want %v", c.queue, v, c.want)
		}
	}
	if m := s.metric("stagedrain_jobs_pushed_total", "queue", "broken"); m != nil && m.GetCounter().GetValue() != 0 {
		t.Errorf("jobs_pushed_total{queue=\"broken\"} = %v, want none pushed", m.GetCounter().GetValue())
	}
	batches := s.value("stagedrain_batches_total")
	if batches < 1 {
		t.Errorf("batches_total = %v, want >= 1", batches)
	}
	if n, sum := s.histogram("stagedrain_batch_size"); float64(n) != batches || sum != 6 {
		t.Errorf("batch_size count %d, sum %v; want one per batch (%v), 6 rows claimed in all", n, sum, batches)
	}
	if n, sum := s.histogram("stagedrain_batch_duration_seconds"); float64(n) != batches || sum <= 0 {
		t.Errorf("batch_duration_seconds count %d, sum %v; want %v batches taking some time", n, sum, batches)
	}
	if n, sum := s.histogram("stagedrain_job_latency_seconds"); n != 5 || sum <= 0 || sum > 5*10 {
		t.Errorf("job_latency_seconds count %d, sum %v; want the 5 pushed jobs, each within 10s", n, sum)
	}
	if v := s.value("stagedrain_wakeups_total", "cause", "notify"); v < 1 {
		t.Errorf("wakeups_total{cause=notify} = %v, want >= 1: the commit found the relay idle", v)
	}

	// Redis down: the batch fails, and its rows stay staged.
	srv.Stop()
	h.stageMany(relay.Job{Name: "A", Queue: "alpha"}, relay.Job{Name: "A", Queue: "alpha"})
	s = waitMetric(t, url, "redis errors and the backlog of 2", func(s scraped) (bool, string) {
		e, b := s.value("stagedrain_errors_total", "kind", "redis"), s.value("stagedrain_backlog_jobs")
		age := s.value("stagedrain_oldest_job_age_seconds")
		return e >= 1 && b == 2 && age > 0, fmt.Sprintf("redis errors %v, backlog %v, oldest age %v", e, b, age)
	})
	if age := s.value("stagedrain_oldest_job_age_seconds"); age > 60 {
		t.Errorf("oldest_job_age_seconds = %v, want the age of jobs staged a moment ago", age)
	}
	if v := s.value("stagedrain_jobs_pushed_total", "queue", "alpha", "target", "sidekiq"); v != 3 {
		t.Errorf("jobs_pushed_total{queue=\"alpha\"} = %v while Redis is down, want 3", v)
	}
	srv.Start()
	h.waitStaged(0)
	waitMetric(t, url, "the backlog drained", func(s scraped) (bool, string) {
		p, b := s.value("stagedrain_jobs_pushed_total", "queue", "alpha", "target", "sidekiq"), s.value("stagedrain_backlog_jobs")
		return p == 5 && b == 0, fmt.Sprintf("alpha pushed %v, backlog %v", p, b)
	})

	// A standby in the same process: its own registry.
	cfg2 := h.config()
	cfg2.Redis = rdb
	standby := h.start(cfg2)
	testenv.WaitFor(t, 10*time.Second, "the second relay to stand by", func() (bool, string) {
		st := standby.Status()
		return st.Role == relay.RoleStandby, string(st.Role)
	})
	ts2 := httptest.NewServer(standby.MetricsHandler())
	t.Cleanup(ts2.Close)
	s = scrapeMetrics(t, ts2.URL+"/metrics")
	if v := s.value("stagedrain_leader"); v != 0 {
		t.Errorf("standby: stagedrain_leader = %v, want 0", v)
	}
	if m := s.metric("stagedrain_backlog_jobs"); m != nil {
		t.Errorf("standby reports stagedrain_backlog_jobs %v; only the leader does", m)
	}
	if n, _ := s.histogram("stagedrain_batch_size"); n != 0 {
		t.Errorf("standby: batch_size count %d, want 0 (the leader's batches are not its own)", n)
	}

	// The leader's lock connection dies: lost_lock.
	var pid int32
	err := h.conn.QueryRow(ctx, `SELECT pid FROM pg_locks
		WHERE locktype = 'advisory' AND objsubid = 1 AND granted
		  AND (classid::bigint << 32 | objid::bigint) = hashtextextended($1, 0)
		  AND pid IN (SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'stagedrain leader %')`,
		"stagedrain:"+h.schema).Scan(&pid)
	if err != nil {
		t.Fatalf("find the leader's lock: %v", err)
	}
	var ok bool
	if err := h.conn.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pid).Scan(&ok); err != nil || !ok {
		t.Fatalf("pg_terminate_backend(%d) = %v, %v", pid, ok, err)
	}
	waitMetric(t, url, "a lost_lock error", func(s scraped) (bool, string) {
		v := s.value("stagedrain_errors_total", "kind", "lost_lock")
		return v >= 1, fmt.Sprintf("lost_lock errors %v", v)
	})
	// One of the two leads again, and only one.
	testenv.WaitFor(t, 20*time.Second, "one leader again", func() (bool, string) {
		a := scrapeMetrics(t, url).value("stagedrain_leader")
		b := scrapeMetrics(t, ts2.URL+"/metrics").value("stagedrain_leader")
		return a+b == 1, fmt.Sprintf("leader gauges %v and %v", a, b)
	})
}

// stagedrain_notify_queue_usage is the leader's sample of
// pg_notification_queue_usage(): 0 on a server whose listeners keep up, and
// what PostgreSQL reports once a listener stops reading (here a session
// that LISTENs and then holds a transaction open, which keeps it from
// reading) while notifications are sent. A private server: the queue is
// the whole server's.
func TestNotifyQueueUsageGauge(t *testing.T) {
	t.Parallel()
	pg := testenv.StartPostgres(t)
	h := &harness{t: t, schema: "jobs"}
	h.rdb, h.ns = testenv.Redis(t)
	h.conn = testenv.Conn(t, pg.URL())
	ctx := context.Background()
	if _, err := relay.Migrate(ctx, h.conn, h.schema); err != nil {
		t.Fatal(err)
	}
	h.stager = relay.NewStager(h.schema)
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	r, idle := h.startSignaled(cfg)
	relay.SetBacklogTTL(r, 0)
	ts := httptest.NewServer(r.MetricsHandler())
	t.Cleanup(ts.Close)
	url := ts.URL + "/metrics"
	h.waitIdleAfterListen(idle)

	if v := scrapeMetrics(t, url).value("stagedrain_notify_queue_usage"); v != 0 {
		t.Fatalf("stagedrain_notify_queue_usage = %v with every listener reading, want 0", v)
	}

	lagging := testenv.Conn(t, pg.URL())
	if _, err := lagging.Exec(ctx, "LISTEN h6_lagging"); err != nil {
		t.Fatal(err)
	}
	tx, err := lagging.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	// About 40 of the queue's 8kB pages.
	if _, err := h.conn.Exec(ctx, `SELECT pg_notify('h6_lagging', i || repeat('x', 7000)) FROM generate_series(1, 50) i`); err != nil {
		t.Fatal(err)
	}
	var want float64
	if err := h.conn.QueryRow(ctx, "SELECT pg_notification_queue_usage()").Scan(&want); err != nil {
		t.Fatal(err)
	}
	if want <= 0 {
		t.Fatalf("pg_notification_queue_usage() = %v behind a listener that does not read, want > 0", want)
	}
	if v := scrapeMetrics(t, url).value("stagedrain_notify_queue_usage"); v != want {
		t.Fatalf("stagedrain_notify_queue_usage = %v behind a listener that does not read, want %v (pg_notification_queue_usage())", v, want)
	}
}
