package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// testBinary is the stagedrain binary the process tests run, built once by
// the first of them into a directory TestMain removes.
var testBinary struct {
	once sync.Once
	dir  string
	path string
	err  error
}

func TestMain(m *testing.M) {
	// run reads these; the in-process tests must see only what they set.
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if isStagedrainEnv(name) {
			os.Unsetenv(name)
		}
	}
	// As main does: the in-process relays' failed dials would print here.
	redis.SetLogger(silentRedisLog{})
	dir, err := os.MkdirTemp("", "stagedrain-cmd-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	testBinary.dir = dir
	goleak.VerifyTestMain(m, goleak.Cleanup(func(code int) {
		os.RemoveAll(dir)
		os.Exit(code)
	}))
}

// isStagedrainEnv reports whether the environment variable name configures
// stagedrain.
func isStagedrainEnv(name string) bool {
	return name == "DATABASE_URL" || name == "REDIS_URL" || strings.HasPrefix(name, "STAGEDRAIN_")
}

// binary returns the path of the stagedrain binary, building it on first use.
func binary(t *testing.T) string {
	t.Helper()
	b := &testBinary
	b.once.Do(func() {
		path := filepath.Join(b.dir, "stagedrain")
		out, err := exec.Command("go", "build", "-o", path, ".").CombinedOutput()
		if err != nil {
			b.err = fmt.Errorf("go build: %v\n%s", err, out)
			return
		}
		b.path = path
	})
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.path
}

// childEnv is this process's environment without any stagedrain variable,
// plus the shared test servers as DATABASE_URL and REDIS_URL, plus extra.
func childEnv(extra ...string) []string {
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if !isStagedrainEnv(name) {
			env = append(env, kv)
		}
	}
	env = append(env, "DATABASE_URL="+relaytest.DatabaseURL(), "REDIS_URL="+relaytest.RedisURL())
	return append(env, extra...)
}

// proc is a running stagedrain process whose output is collected line by
// line. It is killed, if still running, when the test ends.
type proc struct {
	t      *testing.T
	name   string
	cmd    *exec.Cmd
	stdout *lineLog
	stderr *lineLog
	exited chan struct{} // closed once Wait has returned
	err    error         // Wait's result, set before exited is closed
	// failTail, when above 0, limits what a failing test shows of the
	// process's stdout to its last failTail lines (a long-running relay).
	failTail int
}

// startProc starts the stagedrain binary with args and env (see childEnv).
// name tells processes apart in failure messages.
func startProc(t *testing.T, name string, env []string, args ...string) *proc {
	t.Helper()
	p := &proc{
		t:      t,
		name:   name,
		cmd:    exec.Command(binary(t), args...),
		stdout: newLineLog(),
		stderr: newLineLog(),
		exited: make(chan struct{}),
	}
	p.cmd.Env = env
	// exec copies each stream into its writer in a goroutine of its own,
	// which Wait awaits: the lines are complete once exited is closed.
	p.cmd.Stdout = p.stdout
	p.cmd.Stderr = p.stderr
	p.cmd.WaitDelay = 5 * time.Second
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		p.stdout.close()
		p.stderr.close()
		close(p.exited)
	}()
	t.Cleanup(func() {
		_ = p.cmd.Process.Kill() // os.ErrProcessDone when it has exited
		select {
		case <-p.exited:
		case <-time.After(10 * time.Second):
			t.Errorf("%s: still running 10s after SIGKILL", name)
		}
		if t.Failed() {
			if p.failTail > 0 {
				t.Logf("%s output (the last %d lines of stdout):\n%s", name, p.failTail, p.tail(p.failTail))
			} else {
				t.Logf("%s output:\n%s", name, p.output())
			}
		}
	})
	return p
}

// signal sends sig to the process.
func (p *proc) signal(sig syscall.Signal) {
	p.t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		p.t.Fatalf("%s: send %v: %v", p.name, sig, err)
	}
}

// wait waits for the process to exit and returns its exit code (-1 when a
// signal killed it).
func (p *proc) wait(timeout time.Duration) int {
	p.t.Helper()
	select {
	case <-p.exited:
	case <-time.After(timeout):
		p.t.Fatalf("%s: still running after %s; output:\n%s", p.name, timeout, p.output())
	}
	var ee *exec.ExitError
	if p.err != nil && !errors.As(p.err, &ee) {
		p.t.Fatalf("%s: wait: %v", p.name, p.err)
	}
	return p.cmd.ProcessState.ExitCode()
}

// waitLog waits until the process logs a JSON line with message msg from
// logger, and returns it.
func (p *proc) waitLog(logger, msg string, timeout time.Duration) logLine {
	p.t.Helper()
	ln, err := p.stdout.wait(timeout, func(l logLine) bool { return l.is(logger, msg) })
	if err != nil {
		p.t.Fatalf("%s: log line %s %q: %v; output:\n%s", p.name, logger, msg, err, p.output())
	}
	return ln
}

// count returns the number of JSON lines logged so far with message msg from
// logger.
func (p *proc) count(logger, msg string) int {
	n := 0
	for _, l := range p.stdout.snapshot() {
		if l.is(logger, msg) {
			n++
		}
	}
	return n
}

// output is everything the process wrote, for a failure message.
func (p *proc) output() string {
	var b strings.Builder
	for _, l := range p.stdout.snapshot() {
		fmt.Fprintf(&b, "  stdout: %s\n", l.raw)
	}
	for _, l := range p.stderr.snapshot() {
		fmt.Fprintf(&b, "  stderr: %s\n", l.raw)
	}
	return b.String()
}

// tail is output with only the last n lines of stdout.
func (p *proc) tail(n int) string {
	var b strings.Builder
	stdout := p.stdout.snapshot()
	for _, l := range stdout[max(0, len(stdout)-n):] {
		fmt.Fprintf(&b, "  stdout: %s\n", l.raw)
	}
	for _, l := range p.stderr.snapshot() {
		fmt.Fprintf(&b, "  stderr: %s\n", l.raw)
	}
	return b.String()
}

// logLine is one line of a process's output.
type logLine struct {
	raw    string
	fields map[string]any // nil when raw is not a JSON object
	seen   time.Time      // when the test read it
	index  int            // its position in the output, from 0
}

func (l logLine) str(key string) string { s, _ := l.fields[key].(string); return s }

func (l logLine) is(logger, msg string) bool {
	return l.fields != nil && l.str("logger") == logger && l.str("msg") == msg
}

// time is the line's own "time" field (RFC 3339 with nanoseconds).
func (l logLine) time() (time.Time, error) {
	return time.Parse(time.RFC3339Nano, l.str("time"))
}

// lineLog is an io.Writer that splits what is written into lines, each
// parsed as JSON when it is, and lets a test wait for a line.
type lineLog struct {
	mu      sync.Mutex
	partial []byte
	lines   []logLine
	closed  bool
	changed chan struct{} // closed and replaced when lines or closed change
}

func newLineLog() *lineLog { return &lineLog{changed: make(chan struct{})} }

func (l *lineLog) Write(b []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.partial = append(l.partial, b...)
	for {
		i := bytes.IndexByte(l.partial, '\n')
		if i < 0 {
			break
		}
		l.addLocked(string(l.partial[:i]))
		l.partial = l.partial[i+1:]
	}
	return len(b), nil
}

func (l *lineLog) addLocked(s string) {
	ln := logLine{raw: s, seen: time.Now(), index: len(l.lines)}
	if err := json.Unmarshal([]byte(s), &ln.fields); err != nil {
		ln.fields = nil
	}
	l.lines = append(l.lines, ln)
	close(l.changed)
	l.changed = make(chan struct{})
}

// close ends the log: what is left without a newline becomes its last line.
func (l *lineLog) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.partial) > 0 {
		l.addLocked(string(l.partial))
		l.partial = nil
	}
	l.closed = true
	close(l.changed)
	l.changed = make(chan struct{})
}

func (l *lineLog) snapshot() []logLine {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]logLine(nil), l.lines...)
}

// wait returns the first line that matches, waiting for it up to timeout;
// it gives up early when the log ends without one.
func (l *lineLog) wait(timeout time.Duration, match func(logLine) bool) (logLine, error) {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	next := 0
	for {
		l.mu.Lock()
		for ; next < len(l.lines); next++ {
			if match(l.lines[next]) {
				ln := l.lines[next]
				l.mu.Unlock()
				return ln, nil
			}
		}
		closed, changed := l.closed, l.changed
		l.mu.Unlock()
		if closed {
			return logLine{}, fmt.Errorf("the process exited without it")
		}
		select {
		case <-changed:
		case <-deadline.C:
			return logLine{}, fmt.Errorf("not seen within %s", timeout)
		}
	}
}
