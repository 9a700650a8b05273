package main

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// privatePostgres is a private PostgreSQL 15 cluster for a test that stops
// and starts it, as relay/internal/testenv's PostgresServer (which Go's
// internal rule keeps out of this package's reach): trust auth on a free
// loopback port, run as the postgres user when the test runs as root
// (PostgreSQL refuses root), stopped and removed when the test ends.
type privatePostgres struct {
	t    *testing.T
	port int
	dir  string // the data directory
}

// postgresBin is where Debian installs PostgreSQL 15's server programs.
const postgresBin = "/usr/lib/postgresql/15/bin"

func startPrivatePostgres(t *testing.T) *privatePostgres {
	t.Helper()
	parent, err := os.MkdirTemp("", "stagedrain-pg-")
	if err != nil {
		t.Fatal(err)
	}
	s := &privatePostgres{t: t, port: freePort(t), dir: filepath.Join(parent, "data")}
	t.Cleanup(func() {
		s.stop()
		_ = os.RemoveAll(parent)
	})
	if err := os.Chmod(parent, 0o777); err != nil { // the postgres user writes there
		t.Fatal(err)
	}
	if out, err := s.cmd("initdb", "-D", s.dir, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8").CombinedOutput(); err != nil {
		t.Fatalf("initdb: %v\n%s", err, out)
	}
	s.start()
	return s
}

// cmd runs one of PostgreSQL's programs, as the postgres user when we are
// root.
func (s *privatePostgres) cmd(prog string, args ...string) *exec.Cmd {
	prog = filepath.Join(postgresBin, prog)
	if os.Geteuid() == 0 {
		return exec.Command("runuser", append([]string{"-u", "postgres", "--", prog}, args...)...)
	}
	return exec.Command(prog, args...)
}

// url is a connection URL for the cluster's postgres database.
func (s *privatePostgres) url() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.port)
}

// start starts the cluster and waits until it accepts connections.
func (s *privatePostgres) start() {
	s.t.Helper()
	opts := fmt.Sprintf("-p %d -c listen_addresses=127.0.0.1 -c unix_socket_directories='' -c fsync=off", s.port)
	out, err := s.cmd("pg_ctl", "-D", s.dir, "-o", opts, "-w", "-t", "30", "-l", filepath.Join(filepath.Dir(s.dir), "log"), "start").CombinedOutput()
	if err != nil {
		s.t.Fatalf("pg_ctl start: %v\n%s", err, out)
	}
}

// stop stops the cluster at once (fast mode: sessions are disconnected,
// what was committed is kept). Stopping a stopped cluster does nothing.
func (s *privatePostgres) stop() {
	if _, err := os.Stat(filepath.Join(s.dir, "postmaster.pid")); errors.Is(err, os.ErrNotExist) {
		return
	}
	if out, err := s.cmd("pg_ctl", "-D", s.dir, "-m", "fast", "-w", "stop").CombinedOutput(); err != nil {
		s.t.Errorf("pg_ctl stop: %v\n%s", err, out)
	}
}
