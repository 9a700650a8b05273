package main

import (
	"context"
	"net"
	"syscall"
	"testing"
	"time"
)

// run's Redis client dials with the relay's TCP keepalives (probes after 5s
// of silence, every 2s, 3 of them), so a Redis host that vanishes is found
// within seconds on an idle connection.
func TestRunRedisKeepAlive(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	opts, err := runRedisOptions("redis://" + ln.Addr().String() + "/0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := opts.Dialer(ctx, "tcp", ln.Addr().String())
	if err != nil {
		t.Fatalf("dial: %v", err)
	}
	defer c.Close()
	raw, err := c.(syscall.Conn).SyscallConn()
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
	if got != [4]int{1, 5, 2, 3} {
		t.Errorf("Redis socket keepalive (on, idle s, interval s, count) = %v, want [1 5 2 3]", got)
	}
}
