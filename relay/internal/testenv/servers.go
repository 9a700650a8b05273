package testenv

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisServer is a private redis-server for a test that stops or restarts
// Redis. It is stopped when the test ends.
type RedisServer struct {
	t    testing.TB
	Port int
	dir  string // its working directory, kept across Stop and Start
	args []string
	cmd  *exec.Cmd
	// exited is closed once cmd has exited (and been waited for).
	exited  chan struct{}
	started bool // it has run: its port is known to its clients
}

// StartRedis starts redis-server on a free loopback port, keeping nothing on
// disk, and waits until it answers PING (with an error reply, such as NOAUTH,
// if args make it require a password). args are added to redis-server's
// command line, e.g. "--requirepass", "secret", or "--appendonly", "yes"
// to keep what it acknowledged across Stop and Start (its directory stays).
func StartRedis(t testing.TB, args ...string) *RedisServer {
	t.Helper()
	s := &RedisServer{t: t, Port: FreePort(t), dir: t.TempDir(), args: args}
	s.Start()
	t.Cleanup(s.Stop)
	return s
}

// URL is the server's redis:// URL, DB 0.
func (s *RedisServer) URL() string { return fmt.Sprintf("redis://127.0.0.1:%d/0", s.Port) }

// Start starts the server on its port (again, after Stop) and waits until it
// answers PING. A first start whose port was taken meanwhile (redis-server
// exits) moves to another free port and tries again; a restart keeps its
// port, which its clients know.
func (s *RedisServer) Start() {
	s.t.Helper()
	if s.cmd != nil {
		s.t.Fatal("redis-server already running")
	}
	for try := 1; ; try++ {
		logFile := filepath.Join(s.dir, "redis-server.log")
		cmd := exec.Command("redis-server", append([]string{
			"--port", strconv.Itoa(s.Port), "--bind", "127.0.0.1",
			"--save", "", "--appendonly", "no", "--dir", s.dir,
			"--daemonize", "no", "--loglevel", "warning", "--logfile", logFile}, s.args...)...)
		if err := cmd.Start(); err != nil {
			s.t.Fatalf("start redis-server: %v", err)
		}
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		s.cmd, s.exited = cmd, exited
		if s.answers() {
			s.started = true
			return
		}
		s.cmd = nil
		out, _ := os.ReadFile(logFile)
		if !s.started && try < 5 && strings.Contains(string(out), "Address already in use") {
			s.t.Logf("redis-server could not bind port %d; trying another", s.Port)
			s.Port = FreePort(s.t)
			continue
		}
		s.t.Fatalf("redis-server on port %d exited before it answered PING: %v\nits log:\n%s", s.Port, cmd.ProcessState, out)
	}
}

// answers waits until the server answers PING, and is false if it exits
// first.
func (s *RedisServer) answers() bool {
	s.t.Helper()
	rdb := redis.NewClient(&redis.Options{Addr: fmt.Sprintf("127.0.0.1:%d", s.Port), DisableIdentity: true, MaxRetries: -1})
	defer rdb.Close()
	exited := false
	WaitFor(s.t, 10*time.Second, "redis-server to answer PING", func() (bool, string) {
		select {
		case <-s.exited:
			exited = true
			return true, "exited"
		default:
		}
		err := rdb.Ping(context.Background()).Err()
		// NOAUTH is an answer, to a client with no password; LOADING (an
		// append-only file read back after a restart) is not yet.
		var answer redis.Error
		return err == nil || errors.As(err, &answer) && !strings.HasPrefix(err.Error(), "LOADING"), fmt.Sprint(err)
	})
	return !exited
}

// Signal sends sig to the running server (SIGSTOP freezes it: its socket
// still accepts connections, and what clients send waits in its buffers
// until SIGCONT).
func (s *RedisServer) Signal(sig os.Signal) {
	s.t.Helper()
	if s.cmd == nil {
		s.t.Fatal("redis-server not running")
	}
	if err := s.cmd.Process.Signal(sig); err != nil {
		s.t.Fatalf("signal redis-server: %v", err)
	}
}

// WarmPool makes rdb's pool hold n open connections, each past its
// handshake, as a busy client's does: n blocking commands at once, each on
// a connection of its own. A command retried after a timeout then goes out
// at once on another of them, even to a frozen server.
func WarmPool(t testing.TB, rdb *redis.Client, n int) {
	t.Helper()
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() { _ = rdb.Do(context.Background(), "BLPOP", "testenv:warm:nothing", "0.05").Err() })
	}
	wg.Wait()
	if got := rdb.PoolStats().TotalConns; got < uint32(n) {
		t.Fatalf("pool holds %d connections, want %d", got, n)
	}
}

// Stop kills the server and waits for it to exit. Stopping a stopped server
// does nothing.
func (s *RedisServer) Stop() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Kill()
	<-s.exited
	s.cmd = nil
}

// PostgresServer is a private PostgreSQL cluster for a test that stops or
// restarts PostgreSQL. It runs as the postgres OS user when the test runs as
// root (PostgreSQL refuses root), with trust auth on a free loopback port,
// and is stopped and removed when the test ends.
type PostgresServer struct {
	t        testing.TB
	Port     int
	dir      string
	settings []string
	slot     string // a standby's replication slot on its primary, or ""
	started  bool   // it has run: its port is known to its clients
}

// PostgresBin is the directory of PostgreSQL's server programs (initdb,
// pg_ctl): $PG_BIN, else the newest of Debian's /usr/lib/postgresql/*/bin,
// else "" (they are looked up on $PATH).
func PostgresBin() string {
	if d := os.Getenv("PG_BIN"); d != "" {
		return d
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	best, bestVersion := "", -1
	for _, d := range dirs {
		v, err := strconv.Atoi(filepath.Base(filepath.Dir(filepath.Dir(d))))
		if err == nil && v > bestVersion {
			best, bestVersion = filepath.Dir(d), v
		}
	}
	return best
}

// StartPostgres creates and starts a private cluster. settings are server
// settings, name=value, given to the server as -c name=value (for one that
// needs a restart, such as max_prepared_transactions=2).
func StartPostgres(t testing.TB, settings ...string) *PostgresServer {
	t.Helper()
	parent, err := os.MkdirTemp("", "stagedrain-pg-")
	if err != nil {
		t.Fatal(err)
	}
	s := &PostgresServer{t: t, Port: FreePort(t), dir: filepath.Join(parent, "data"), settings: settings}
	t.Cleanup(func() {
		s.Stop()
		_ = os.RemoveAll(parent)
	})
	if err := os.Chmod(parent, 0o777); err != nil {
		t.Fatal(err)
	}
	if out, err := s.pgCmd(filepath.Join(PostgresBin(), "initdb"), "-D", s.dir, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8").CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	s.Start()
	return s
}

// pgCmd runs a PostgreSQL program as the postgres user when we are root.
func (s *PostgresServer) pgCmd(prog string, args ...string) *exec.Cmd {
	if os.Geteuid() == 0 {
		return exec.Command("runuser", append([]string{"-u", "postgres", "--", prog}, args...)...)
	}
	return exec.Command(prog, args...)
}

// URL is a connection URL for the cluster's postgres database.
func (s *PostgresServer) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.Port)
}

// Start starts the cluster and waits until it accepts connections. A
// first start whose port was taken meanwhile (the server's log says it could
// not bind) moves to another free port and tries again; a restart keeps its
// port, which its clients know.
func (s *PostgresServer) Start() {
	s.t.Helper()
	for try := 1; ; try++ {
		out, err := s.start()
		if err == nil {
			s.started = true
			return
		}
		log := s.logTail()
		if !s.started && try < 5 && strings.Contains(log, "could not bind") {
			s.t.Logf("PostgreSQL could not bind port %d; trying another", s.Port)
			s.Port = FreePort(s.t)
			continue
		}
		s.t.Fatalf("pg_ctl start (port %d): %v\n%s\nthe server's log ends:\n%s", s.Port, err, out, log)
	}
}

func (s *PostgresServer) start() ([]byte, error) {
	opts := fmt.Sprintf("-p %d -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c fsync=off", s.Port)
	for _, kv := range s.settings {
		opts += " -c " + kv
	}
	return s.pgCmd(filepath.Join(PostgresBin(), "pg_ctl"), "-D", s.dir, "-o", opts, "-w", "-t", "30", "-l", s.logFile(), "start").CombinedOutput()
}

func (s *PostgresServer) logFile() string { return filepath.Join(filepath.Dir(s.dir), "log") }

// logTail is the last 20 lines of the server's log.
func (s *PostgresServer) logTail() string {
	b, err := os.ReadFile(s.logFile())
	if err != nil {
		return fmt.Sprintf("(log unreadable: %v)", err)
	}
	lines := strings.Split(strings.TrimRight(string(b), "\n"), "\n")
	return strings.Join(lines[max(0, len(lines)-20):], "\n")
}

// Stop stops the cluster at once (fast mode: sessions are disconnected).
func (s *PostgresServer) Stop() {
	if _, err := os.Stat(filepath.Join(s.dir, "postmaster.pid")); errors.Is(err, os.ErrNotExist) {
		return
	}
	if out, err := s.pgCmd(filepath.Join(PostgresBin(), "pg_ctl"), "-D", s.dir, "-m", "fast", "-w", "stop").CombinedOutput(); err != nil {
		s.t.Errorf("pg_ctl stop: %v\n%s", err, out)
	}
}
