package relay_test

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// A relay stops (Run returns) soon after its context ends even when a
// statement of its drain pool waits on a backend that will not answer.
// pgx closes the interrupted connection by sending Terminate and waiting
// up to 15s for the server to hang up, and pgxpool's Close waits for that:
// a relay stopped beside a frozen backend, or over TLS with a write the
// stop interrupted (the server then never gets the Terminate), took 15s
// to exit.
func TestStopsWithADrainBackendFrozen(t *testing.T) {
	t.Parallel()
	h, pg := privateHarness(t)
	cfg := h.config()
	cfg.DatabaseURL = pg.URL()
	cfg.PollInterval = 100 * time.Millisecond // a poll soon after the freeze
	r, err := relay.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	idle := idleEvents(r)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var frozen []int
	thaw := func() {
		for _, pid := range frozen {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
		frozen = nil
	}
	// Registered after StartPostgres, so it runs before the server stops.
	t.Cleanup(func() {
		cancel()
		thaw()
		<-done
	})
	h.waitIdleAfterListen(idle)

	rows, err := h.conn.Query(context.Background(), `SELECT pid, client_port FROM pg_stat_activity
		WHERE application_name LIKE 'stagedrain drain %' AND pid <> pg_backend_pid()`)
	if err != nil {
		t.Fatal(err)
	}
	var ports []int
	for rows.Next() {
		var pid, port int
		if err := rows.Scan(&pid, &port); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			t.Fatalf("SIGSTOP backend %d: %v", pid, err)
		}
		frozen = append(frozen, pid)
		ports = append(ports, port)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(frozen) == 0 {
		t.Fatal("the idle relay has no drain session")
	}
	// A statement has reached a frozen backend when its socket holds
	// bytes the backend has not read.
	testenv.WaitFor(t, 15*time.Second, "a statement waiting at a frozen drain backend", func() (bool, string) {
		n, err := unreadAtServer(pg.Port, ports)
		if err != nil {
			t.Fatal(err)
		}
		return n > 0, fmt.Sprintf("no unread bytes at backends %v (client ports %v)", frozen, ports)
	})

	stopped := time.Now()
	cancel()
	select {
	case err := <-done:
		done <- err // for the cleanup
		if err != nil {
			t.Errorf("Run returned %v, want nil after cancel", err)
		}
		t.Logf("Run returned %s after cancel, with drain backends %v frozen", time.Since(stopped), frozen)
	case <-time.After(10 * time.Second):
		t.Fatalf("Run did not return within 10s of cancel with drain backends %v frozen (pgx closes their connections for up to 15s); logs: %v", frozen, messages(h.logs))
	}
	if n := h.logs.FilterMessage("a connection of the drain pool is still closing: not waiting for it").Len(); n != 1 {
		t.Errorf("logged %d times that the drain pool's connections were left closing, want 1; logs: %v", n, messages(h.logs))
	}
}

// unreadAtServer sums the bytes waiting unread in the receive queues of
// the server's ends (local port server) of the TCP connections from the
// client ports clients, from /proc/net/tcp.
func unreadAtServer(server int, clients []int) (int, error) {
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		return 0, err
	}
	port := func(addr string) int {
		_, p, _ := strings.Cut(addr, ":")
		n, _ := strconv.ParseInt(p, 16, 32)
		return int(n)
	}
	total := 0
	for _, l := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(l)
		if len(f) < 5 || port(f[1]) != server || !slices.Contains(clients, port(f[2])) {
			continue
		}
		_, rx, _ := strings.Cut(f[4], ":")
		n, err := strconv.ParseInt(rx, 16, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/net/tcp: rx_queue %q: %w", f[4], err)
		}
		total += int(n)
	}
	return total, nil
}
