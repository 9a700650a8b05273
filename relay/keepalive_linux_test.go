package relay_test

import (
	"context"
	"crypto/tls"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stagedrain/stagedrain/relay"
	"github.com/stagedrain/stagedrain/relay/internal/testenv"
)

// Every connection the relay opens to PostgreSQL keeps TCP alive from both
// ends (relay.KeepAlive: probes after 5s of silence, every 2s, 3 of them),
// and gives up connecting after 10s unless the URL says otherwise.
func TestConnectionsKeepAlive(t *testing.T) {
	t.Parallel()
	rdb, _ := testenv.Redis(t)
	r, err := relay.New(relay.Config{DatabaseURL: testenv.DatabaseURL(), Redis: rdb})
	if err != nil {
		t.Fatal(err)
	}
	ka := relay.KeepAlive()
	if !ka.Enable || ka.Idle != 5*time.Second || ka.Interval != 2*time.Second || ka.Count != 3 {
		t.Fatalf("KeepAlive() = %+v, want enabled, 5s idle, 2s interval, 3 probes", ka)
	}
	for _, role := range []string{"leader", "listener", "drain"} {
		cc := relay.ConnConfig(r, role)
		if cc.ConnectTimeout != 10*time.Second {
			t.Errorf("%s: connect timeout %s, want 10s", role, cc.ConnectTimeout)
		}
		conn, err := pgx.ConnectConfig(context.Background(), cc)
		if err != nil {
			t.Fatalf("%s: connect: %v", role, err)
		}
		// The server's end of the socket.
		for name, want := range map[string]string{"tcp_keepalives_idle": "5", "tcp_keepalives_interval": "2", "tcp_keepalives_count": "3"} {
			var got string
			if err := conn.QueryRow(context.Background(), "SHOW "+name).Scan(&got); err != nil || got != want {
				t.Errorf("%s: SHOW %s = %q (%v), want %q", role, name, got, err, want)
			}
		}
		// The relay's end.
		if got := keepAliveOf(t, conn.PgConn().Conn()); got != [4]int{1, 5, 2, 3} {
			t.Errorf("%s: socket keepalive (on, idle s, interval s, count) = %v, want [1 5 2 3]", role, got)
		}
		conn.Close(context.Background())
	}

	// The listener's server end gives up on unacknowledged data (the
	// notifications it sends) as soon as keepalives would: tcp_user_timeout.
	conn, err := pgx.ConnectConfig(context.Background(), relay.ListenerConnConfig(r))
	if err != nil {
		t.Fatalf("listener: connect: %v", err)
	}
	var userTimeout string
	if err := conn.QueryRow(context.Background(), "SHOW tcp_user_timeout").Scan(&userTimeout); err != nil || userTimeout != "11000" {
		t.Errorf("listener: SHOW tcp_user_timeout = %q (%v), want 11000 (ms)", userTimeout, err)
	}
	conn.Close(context.Background())

	// connect_timeout in the URL wins.
	url := testenv.DatabaseURL()
	if strings.Contains(url, "?") {
		url += "&connect_timeout=3"
	} else {
		url += "?connect_timeout=3"
	}
	r, err = relay.New(relay.Config{DatabaseURL: url, Redis: rdb})
	if err != nil {
		t.Fatal(err)
	}
	if got := relay.ConnConfig(r, "leader").ConnectTimeout; got != 3*time.Second {
		t.Errorf("connect timeout with connect_timeout=3 in the URL: %s, want 3s", got)
	}
}

// keepAliveOf reads a TCP socket's SO_KEEPALIVE, TCP_KEEPIDLE,
// TCP_KEEPINTVL and TCP_KEEPCNT: c's own, or the one under its TLS (a URL
// with sslmode=prefer, pgx's default, is TLS where the server has it on).
func keepAliveOf(t *testing.T, c net.Conn) [4]int {
	t.Helper()
	if tc, ok := c.(*tls.Conn); ok {
		c = tc.NetConn()
	}
	sc, ok := c.(syscall.Conn)
	if !ok {
		t.Fatalf("connection %T is not a socket", c)
	}
	raw, err := sc.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var got [4]int
	var opErr error
	err = raw.Control(func(fd uintptr) {
		for i, opt := range [4][2]int{
			{syscall.SOL_SOCKET, syscall.SO_KEEPALIVE},
			{syscall.IPPROTO_TCP, syscall.TCP_KEEPIDLE},
			{syscall.IPPROTO_TCP, syscall.TCP_KEEPINTVL},
			{syscall.IPPROTO_TCP, syscall.TCP_KEEPCNT},
		} {
			if got[i], opErr = syscall.GetsockoptInt(int(fd), opt[0], opt[1]); opErr != nil {
				return
			}
		}
	})
	if err != nil || opErr != nil {
		t.Fatalf("getsockopt: %v %v", err, opErr)
	}
	return got
}
