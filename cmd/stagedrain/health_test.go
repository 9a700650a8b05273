package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// inProcessRelay runs `stagedrain run` in this process (runCmd, so that the
// test can stop it with a context). The stop it returns ends it and checks
// that run returned nil; it runs when the test ends, if not before.
func inProcessRelay(t *testing.T, args ...string) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := newLineLog()
	done := make(chan error, 1)
	go func() { done <- runCmd(ctx, args, out, io.Discard) }()
	stop = sync.OnceFunc(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("run returned %v, want nil", err)
			}
		case <-time.After(15 * time.Second):
			t.Errorf("run still running 15s after its context ended")
		}
		if t.Failed() {
			var b strings.Builder
			for _, l := range out.snapshot() {
				b.WriteString(l.raw + "\n")
			}
			t.Logf("relay output:\n%s", b.String())
		}
	})
	t.Cleanup(stop)
	return stop
}

// get GETs url without keeping the connection (goleak would see it).
func get(url string) (int, string, error) {
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 5 * time.Second}
	resp, err := c.Get(url)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// waitReady waits until addr's /readyz answers code with the role given
// ("" for any), and returns its body.
func waitReady(t *testing.T, addr string, code int, role string) readyBody {
	t.Helper()
	var body readyBody
	relaytest.WaitFor(t, 20*time.Second, fmt.Sprintf("/readyz of %s to answer %d, role %q", addr, code, role), func() (bool, string) {
		got, raw, err := get("http://" + addr + "/readyz")
		if err != nil {
			return false, err.Error()
		}
		body = readyBody{}
		if err := json.Unmarshal([]byte(raw), &body); err != nil {
			return false, fmt.Sprintf("%d, body not JSON: %q", got, raw)
		}
		return got == code && (role == "" || string(body.Role) == role), fmt.Sprintf("%d %s", got, raw)
	})
	return body
}

// checkMetrics GETs addr's /metrics and checks that it is Prometheus's
// text format, with the relay's metrics, Go's and the process's, and that
// each series in want has the value given ("" for a series that must be
// absent). Every stagedrain_ series must carry the label schema="<schema>",
// which want leaves out.
func checkMetrics(t *testing.T, addr, schema string, want map[string]string) {
	t.Helper()
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 10 * time.Second}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("GET /metrics: %v", err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/plain; version=0.0.4") {
		t.Fatalf("GET /metrics of %s: %s, Content-Type %q, %v; want 200 in the text format", addr, resp.Status, resp.Header.Get("Content-Type"), err)
	}
	values := make(map[string]string) // series -> value
	for _, l := range strings.Split(string(raw), "\n") {
		series, value, ok := strings.Cut(l, " ")
		if !ok || strings.HasPrefix(l, "#") {
			continue
		}
		if strings.HasPrefix(series, "stagedrain_") {
			label := `schema="` + schema + `"`
			stripped := strings.NewReplacer("{"+label+"}", "", ","+label, "", "{"+label+",", "{").Replace(series)
			if stripped == series {
				t.Errorf("/metrics of %s: %s has no label %s", addr, series, label)
			}
			series = stripped
		}
		values[series] = value
	}
	for _, series := range []string{"go_goroutines", "process_resident_memory_bytes",
		`stagedrain_wakeups_total{cause="reconnect"}`, `stagedrain_errors_total{kind="redis"}`, "stagedrain_batches_total"} {
		if _, ok := values[series]; !ok {
			t.Errorf("/metrics of %s has no %s", addr, series)
		}
	}
	for series, v := range want {
		if got, ok := values[series]; v == "" && ok {
			t.Errorf("/metrics of %s: %s = %s, want none", addr, series, got)
		} else if v != "" && got != v {
			t.Errorf("/metrics of %s: %s = %q, want %q", addr, series, got, v)
		}
	}
}

// /healthz, /readyz and /metrics of a leader and a standby; /readyz goes 503 while
// Redis is unreachable and 200 once it is back; stagedrain health exits 0
// and 1 accordingly; the listener goes with the relay.
func TestHealthEndpoints(t *testing.T) {
	t.Parallel()
	e := newRelayEnv(t)
	rs := relaytest.StartRedis(t)
	leaderAddr := fmt.Sprintf("127.0.0.1:%d", relaytest.FreePort(t))
	standbyAddr := fmt.Sprintf("127.0.0.1:%d", relaytest.FreePort(t))
	args := func(addr string) []string {
		return []string{"--database-url", relaytest.DatabaseURL(), "--schema", e.schema, "--redis-url", rs.URL(),
			"--leader-interval", "50ms", "--max-backoff", "200ms", "--metrics-addr", addr}
	}

	stopLeader := inProcessRelay(t, args(leaderAddr)...)
	body := waitReady(t, leaderAddr, http.StatusOK, "leader")
	if !body.Ready || body.Since.IsZero() {
		t.Errorf("leader /readyz = %+v, want ready with a since", body)
	}
	code, raw, err := get("http://" + leaderAddr + "/healthz")
	if err != nil || code != http.StatusOK || raw != "ok\n" {
		t.Errorf("/healthz = %d %q, %v; want 200 \"ok\\n\"", code, raw, err)
	}
	checkMetrics(t, leaderAddr, e.schema, map[string]string{"stagedrain_leader": "1", "stagedrain_backlog_jobs": "0"})
	if r := runCLI("health", "--metrics-addr", leaderAddr); r.code != 0 || r.stdout != "ready: leader\n" || r.stderr != "" {
		t.Errorf("health against the leader: exit %d, stdout %q, stderr %q; want 0, \"ready: leader\\n\"", r.code, r.stdout, r.stderr)
	}
	// A listener on every interface is asked on loopback.
	_, port, _ := net.SplitHostPort(leaderAddr)
	if r := runCLI("health", "--metrics-addr", ":"+port); r.code != 0 {
		t.Errorf("health --metrics-addr :%s: exit %d, stderr %q; want 0", port, r.code, r.stderr)
	}

	inProcessRelay(t, args(standbyAddr)...)
	waitReady(t, standbyAddr, http.StatusOK, "standby")
	// Only the leader reports the backlog.
	checkMetrics(t, standbyAddr, e.schema, map[string]string{"stagedrain_leader": "0", "stagedrain_backlog_jobs": ""})
	if r := runCLI("health", "--metrics-addr", standbyAddr); r.code != 0 || r.stdout != "ready: standby\n" {
		t.Errorf("health against the standby: exit %d, stdout %q, stderr %q; want 0, \"ready: standby\\n\"", r.code, r.stdout, r.stderr)
	}

	rs.Stop()
	for _, addr := range []string{leaderAddr, standbyAddr} {
		body := waitReady(t, addr, http.StatusServiceUnavailable, "")
		if body.Ready || !strings.Contains(body.Reason, "redis") {
			t.Errorf("/readyz of %s with Redis down = %+v, want not ready, a reason naming redis", addr, body)
		}
		r := runCLI("health", "--metrics-addr", addr)
		checkOneLineError(t, r, 1, "not ready", "503", "redis")
	}
	code, _, err = get("http://" + leaderAddr + "/healthz")
	if err != nil || code != http.StatusOK {
		t.Errorf("/healthz with Redis down = %d, %v; want 200: the process is alive", code, err)
	}

	rs.Start()
	waitReady(t, leaderAddr, http.StatusOK, "leader")
	waitReady(t, standbyAddr, http.StatusOK, "standby")

	stopLeader()
	// The standby takes over; the stopped relay's listener is gone.
	waitReady(t, standbyAddr, http.StatusOK, "leader")
	r := runCLI("health", "--metrics-addr", leaderAddr)
	checkOneLineError(t, r, 1, "health:")
}

// An address run cannot listen on fails run at once: exit 1, one line
// naming the flag.
func TestMetricsAddrInUse(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	r := runCLI("run", "--database-url", noDatabaseURL(t), "--metrics-addr", l.Addr().String())
	checkOneLineError(t, r, 1, "run: --metrics-addr", "address already in use")
}
