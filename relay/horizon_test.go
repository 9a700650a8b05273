package relay_test

import (
	"context"
	"fmt"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap/zaptest/observer"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// privateHarness is a harness on a private PostgreSQL server: for a test
// that holds the xmin horizon, which would slow every other test on the
// shared server.
func privateHarness(t *testing.T, settings ...string) (*harness, *testenv.PostgresServer) {
	t.Helper()
	pg := testenv.StartPostgres(t, settings...)
	h := &harness{t: t, schema: "jobs"}
	h.rdb, h.ns = testenv.Redis(t)
	h.conn = testenv.Conn(t, pg.URL())
	if _, err := relay.Migrate(context.Background(), h.conn, h.schema); err != nil {
		t.Fatal(err)
	}
	h.stager = relay.NewStager(h.schema)
	return h, pg
}

// holdHorizon holds the server's xmin horizon as pg_dump does (a
// REPEATABLE READ snapshot, no transaction id) until the test ends.
func holdHorizon(t *testing.T, url string) uint32 {
	t.Helper()
	c := testenv.Conn(t, url)
	ctx := context.Background()
	if _, err := c.Exec(ctx, "BEGIN ISOLATION LEVEL REPEATABLE READ"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, "SELECT count(*) FROM pg_class"); err != nil {
		t.Fatal(err)
	}
	return c.PgConn().PID()
}

// stageRows commits n rows in transactions of 100.
func (h *harness) stageRows(n int) {
	h.t.Helper()
	table := pgx.Identifier{h.schema, "staged_jobs"}.Sanitize()
	for n > 0 {
		k := min(n, 100)
		if _, err := h.conn.Exec(context.Background(), `INSERT INTO `+table+` (job_name, job_args)
			SELECT 'Job', '[]' FROM generate_series(1, $1)`, k); err != nil {
			h.t.Fatal(err)
		}
		n -= k
	}
}

// A snapshot held past HorizonWarnAfter is named in one warn line (its
// pid, application_name, state) with the dead rows it costs, and its age
// is the metric stagedrain_xmin_horizon_age_seconds.
func TestHorizonHolderNamedOnce(t *testing.T) {
	// No autovacuum: the rows drained before the snapshot stay dead, so
	// that the warning has a known count to report.
	h, pg := privateHarness(t, "autovacuum=off")
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	cfg.HorizonWarnAfter = time.Second
	r := h.start(cfg)
	ts := httptest.NewServer(r.MetricsHandler())
	t.Cleanup(ts.Close)
	url := ts.URL + "/metrics"

	h.stageRows(500)
	h.waitQueueLen("default", 500, 15*time.Second)
	testenv.WaitFor(t, 30*time.Second, "the relay's deletes counted as dead rows", func() (bool, string) {
		var n int64
		if err := h.conn.QueryRow(context.Background(), `SELECT n_dead_tup FROM pg_stat_user_tables
			WHERE schemaname = 'jobs' AND relname = 'staged_jobs'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n >= 500, fmt.Sprintf("n_dead_tup %d", n)
	})
	pid := holdHorizon(t, pg.URL())
	const msg = "xmin horizon held back: dead rows cannot be removed until it ends"
	h.waitLog(msg, 1)
	// The age passes twice the threshold: the watch has looked again
	// since it warned.
	waitMetric(t, url, "the horizon's age past 2s", func(s scraped) (bool, string) {
		v := s.value("stagedrain_xmin_horizon_age_seconds")
		return v >= 2, fmt.Sprintf("%v", v)
	})
	var lines []observer.LoggedEntry
	for _, l := range h.logs.FilterMessage(msg).All() {
		if l.ContextMap()["backend_pid"] == int32(pid) {
			lines = append(lines, l)
		}
	}
	if len(lines) != 1 {
		for _, l := range lines {
			t.Log(l.ContextMap())
		}
		t.Fatalf("%d warn lines %q naming pid %d, want 1", len(lines), msg, pid)
	}
	f := lines[0].ContextMap()
	if f["backend_pid"] != int32(pid) || f["holder"] != "session" || f["state"] != "idle in transaction" ||
		f["query"] != "SELECT count(*) FROM pg_class" {
		t.Fatalf("warn line fields %v, want pid %d, holder session, state idle in transaction and its query", f, pid)
	}
	if n, _ := f["dead_rows"].(int64); n < 500 {
		t.Errorf("dead_rows = %v, want the 500 rows the relay deleted", f["dead_rows"])
	}
}

// A relay of many schemas serves stagedrain_xmin_horizon_age_seconds
// once, from its own registry, without a schema label: the horizon is
// the database's, not a schema's.
func TestFleetServesHorizonAgeOnce(t *testing.T) {
	fh := newFleetHarness(t, 2)
	r := fh.start(fh.fleetConfig())
	ts := httptest.NewServer(r.MetricsHandler())
	t.Cleanup(ts.Close)
	var want []string
	for _, s := range fh.schemas {
		want = append(want, fh.stageIn(s, "default"))
	}
	fh.waitJIDs("default", want) // both schemas' relays exist
	s := scrapeMetrics(t, ts.URL+"/metrics")
	f := s["stagedrain_xmin_horizon_age_seconds"]
	if f == nil || len(f.GetMetric()) != 1 || len(f.GetMetric()[0].GetLabel()) != 0 {
		t.Fatalf("stagedrain_xmin_horizon_age_seconds: %v, want one sample without labels", f)
	}
	if s["stagedrain_leader"] == nil || len(s["stagedrain_leader"].GetMetric()) != 2 {
		t.Fatalf("stagedrain_leader: %v, want a sample per schema", s["stagedrain_leader"])
	}
}
