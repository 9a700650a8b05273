package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// While Redis does not answer, /readyz and stagedrain health say so,
// "redis unreachable: <redis>: <error>", both at start (the relay waits for
// Redis before it campaigns: it used to say only "starting") and while it
// leads.
func TestReadyzNamesRedisUnreachable(t *testing.T) {
	t.Parallel()
	e := newRelayEnv(t)
	rs := relaytest.StartRedis(t)
	rs.Stop() // nothing listens on its port until rs.Start
	addr := fmt.Sprintf("127.0.0.1:%d", relaytest.FreePort(t))
	inProcessRelay(t, "--database-url", relaytest.DatabaseURL(), "--schema", e.schema, "--redis-url", rs.URL(),
		"--leader-interval", "50ms", "--max-backoff", "200ms", "--metrics-addr", addr)

	want := fmt.Sprintf("redis unreachable: 127.0.0.1:%d/0: ", rs.Port)
	check := func(role string) {
		t.Helper()
		var body readyBody
		relaytest.WaitFor(t, 20*time.Second, fmt.Sprintf("/readyz of %s to answer 503, role %s, a reason %q...", addr, role, want), func() (bool, string) {
			code, raw, err := get("http://" + addr + "/readyz")
			if err != nil {
				return false, err.Error()
			}
			body = readyBody{}
			if err := json.Unmarshal([]byte(raw), &body); err != nil {
				return false, fmt.Sprintf("%d, body not JSON: %q", code, raw)
			}
			return code == http.StatusServiceUnavailable && string(body.Role) == role && strings.HasPrefix(body.Reason, want),
				fmt.Sprintf("%d %s", code, raw)
		})
		if !strings.Contains(body.Reason, "connection refused") {
			t.Errorf("/readyz reason %q, want the dial's error (connection refused)", body.Reason)
		}
		r := runCLI("health", "--metrics-addr", addr)
		checkOneLineError(t, r, 1, "health: not ready (503 Service Unavailable): "+want)
	}
	check("starting")

	rs.Start()
	waitReady(t, addr, http.StatusOK, "leader")
	rs.Stop()
	check("leader")
}
