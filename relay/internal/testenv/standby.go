package testenv

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// StartStandby makes a streaming standby of s (pg_basebackup -R, which
// writes primary_conninfo) and starts it on a free port, with the primary's
// settings. slot, when not "", is a physical replication slot that
// pg_basebackup creates on s for it (-C -S), as Patroni and CloudNativePG
// give each standby. It returns once the standby streams from s. The
// standby is stopped and removed when the test ends.
func (s *PostgresServer) StartStandby(t testing.TB, slot string) *PostgresServer {
	t.Helper()
	parent, err := os.MkdirTemp("", "stagedrain-pg-standby-")
	if err != nil {
		t.Fatal(err)
	}
	sb := &PostgresServer{t: t, Port: FreePort(t), dir: filepath.Join(parent, "data"), settings: s.settings, slot: slot}
	t.Cleanup(func() {
		sb.Stop()
		_ = os.RemoveAll(parent)
	})
	if err := os.Chmod(parent, 0o777); err != nil {
		t.Fatal(err)
	}
	args := []string{"-h", "127.0.0.1", "-p", fmt.Sprint(s.Port), "-U", "postgres", "-D", sb.dir, "-R", "-X", "stream", "--no-sync"}
	if slot != "" {
		args = append(args, "-C", "-S", slot)
	}
	if out, err := sb.pgCmd(filepath.Join(PostgresBin(), "pg_basebackup"), args...).CombinedOutput(); err != nil {
		t.Fatalf("pg_basebackup: %v\n%s", err, out)
	}
	// Its own slot, or none: a standby of a standby, or of one promoted,
	// copies the settings its source got from ALTER SYSTEM (SetReceiving)
	// and pg_basebackup.
	f, err := os.OpenFile(filepath.Join(sb.dir, "postgresql.auto.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err == nil {
		_, err = fmt.Fprintf(f, "primary_slot_name = '%s'\n", slot)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		t.Fatalf("standby: write postgresql.auto.conf: %v", err)
	}
	sb.Start()
	WaitFor(t, 30*time.Second, "the standby streaming", func() (bool, string) {
		var n int
		err := QueryOnce(sb.URL(), `SELECT count(*) FROM pg_stat_wal_receiver WHERE status = 'streaming'`, &n)
		return err == nil && n == 1, fmt.Sprintf("%d streaming receivers, %v", n, err)
	})
	return sb
}

// Promote promotes a standby (pg_ctl promote) and waits until it accepts
// writes.
func (s *PostgresServer) Promote() {
	s.t.Helper()
	if out, err := s.pgCmd(filepath.Join(PostgresBin(), "pg_ctl"), "-D", s.dir, "-w", "-t", "30", "promote").CombinedOutput(); err != nil {
		s.t.Fatalf("pg_ctl promote: %v\n%s", err, out)
	}
}

// Crash stops the server as a crash does (pg_ctl stop -m immediate): no
// checkpoint, sessions cut, and nothing more sent to its standbys.
func (s *PostgresServer) Crash() {
	s.t.Helper()
	if out, err := s.pgCmd(filepath.Join(PostgresBin(), "pg_ctl"), "-D", s.dir, "-m", "immediate", "-w", "stop").CombinedOutput(); err != nil {
		s.t.Fatalf("pg_ctl stop -m immediate: %v\n%s", err, out)
	}
}

// SetReceiving starts (on) or stops (off) a standby's WAL receiver, by
// setting primary_conninfo (reloaded without a restart since PostgreSQL
// 13): stopped, the standby lags the primary as a partitioned or slow
// replica does, and its walsender leaves the primary's
// pg_stat_replication. It waits until the receiver is in that state.
func (s *PostgresServer) SetReceiving(primary *PostgresServer, on bool) {
	s.t.Helper()
	info := ""
	if on {
		info = fmt.Sprintf("host=127.0.0.1 port=%d user=postgres", primary.Port)
	}
	c := Conn(s.t, s.URL())
	defer c.Close(context.Background())
	if _, err := c.Exec(context.Background(), `ALTER SYSTEM SET primary_conninfo = `+quoteLiteral(info)); err != nil {
		s.t.Fatalf("standby: ALTER SYSTEM SET primary_conninfo: %v", err)
	}
	if _, err := c.Exec(context.Background(), `SELECT pg_reload_conf()`); err != nil {
		s.t.Fatalf("standby: reload: %v", err)
	}
	if on {
		WaitFor(s.t, 30*time.Second, "the standby's WAL receiver streaming", func() (bool, string) {
			var n int
			err := c.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_wal_receiver WHERE status = 'streaming'`).Scan(&n)
			return err == nil && n == 1, fmt.Sprintf("%d streaming receivers, %v", n, err)
		})
		return
	}
	// Off means nothing more can arrive: the receiver process is gone (a
	// receiver whose status is already "stopping" can still write what it
	// reads until it exits), and the primary's end of the stream is gone
	// too (its slot is no longer active).
	WaitFor(s.t, 30*time.Second, "the standby's WAL receiver gone, and its slot on the primary inactive", func() (bool, string) {
		var n int
		if err := c.QueryRow(context.Background(), `SELECT count(*) FROM pg_stat_wal_receiver`).Scan(&n); err != nil || n != 0 {
			return false, fmt.Sprintf("%d receivers on the standby, %v", n, err)
		}
		if s.slot == "" {
			return true, ""
		}
		var active bool
		err := QueryOnce(primary.URL(), `SELECT coalesce(bool_or(active), false) FROM pg_replication_slots WHERE slot_name = '`+s.slot+`'`, &active)
		return err == nil && !active, fmt.Sprintf("slot %s active=%v on the primary, %v", s.slot, active, err)
	})
}

// QueryOnce connects to url, scans the one row of sql into dest, and
// disconnects.
func QueryOnce(url, sql string, dest ...any) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer c.Close(context.Background())
	return c.QueryRow(ctx, sql).Scan(dest...)
}

func quoteLiteral(s string) string {
	out := "'"
	for _, r := range s {
		if r == '\'' {
			out += "'"
		}
		out += string(r)
	}
	return out + "'"
}
