package testenv

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// Sidekiq is a running real Sidekiq (Debian's ruby-sidekiq, 6.4), for tests
// that check what a worker makes of what the relay wrote.
type Sidekiq struct {
	mu  sync.Mutex
	out bytes.Buffer
}

// StartSidekiq starts `sidekiq --require file --queue default
// --concurrency 1` reading redisURL, in a process group of its own that is
// killed when the test ends. Its output, stdout and stderr, is String().
func StartSidekiq(t testing.TB, file, redisURL string) *Sidekiq {
	t.Helper()
	file, err := filepath.Abs(file)
	if err != nil {
		t.Fatal(err)
	}
	s := &Sidekiq{}
	cmd := exec.Command("sidekiq", "--require", file, "--queue", "default", "--concurrency", "1")
	cmd.Env = append(slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, "REDIS_URL=") || strings.HasPrefix(kv, "REDIS_PROVIDER=")
	}), "REDIS_URL="+redisURL, "RUBYOPT=-W0") // -W0: Debian's redis gem warns of deprecations on every BRPOP
	cmd.Stdout, cmd.Stderr = s, s
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatalf("start sidekiq (Debian: apt-get install ruby-sidekiq): %v", err)
	}
	t.Cleanup(func() {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		_ = cmd.Wait()
	})
	return s
}

// Write is the process's output.
func (s *Sidekiq) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.out.Write(p)
}

// String is what the process wrote so far.
func (s *Sidekiq) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.out.String()
}
