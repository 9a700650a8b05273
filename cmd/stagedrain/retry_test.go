package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/stagedrain/stagedrain/relay/relaytest"
)

// migrate --migrate waits out a server that answers but cannot take a
// session yet, as it waits out one that does not answer; it gives up at
// once when the server says no for good.
func TestTransient(t *testing.T) {
	t.Parallel()
	refused := &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}
	pg := func(code string) error { return &pgconn.PgError{Severity: "FATAL", Code: code} }
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"connection refused", fmt.Errorf("connect: %w", refused), true},
		{"starting up", pg("57P03"), true},
		{"admin shutdown", pg("57P01"), true},
		{"crash shutdown", pg("57P02"), true},
		{"too many connections", pg("53300"), true},
		{"connection failure", pg("08006"), true},
		{"cannot establish connection", pg("08001"), true},
		{"starting up, after a refused address", fmt.Errorf("connect: %w", errors.Join(refused, pg("57P03"))), true},
		{"bad password", pg("28P01"), false},
		{"no such role", pg("28000"), false},
		{"no such database", pg("3D000"), false},
		{"permission denied", pg("42501"), false},
		{"lock timeout", fmt.Errorf("migrate schema: %w", pg("55P03")), false},
		{"bad password, after a refused address", errors.Join(refused, pg("28P01")), false},
	}
	for _, tt := range tests {
		if got := transient(tt.err); got != tt.want {
			t.Errorf("%s: transient(%v) = %v, want %v", tt.name, tt.err, got, tt.want)
		}
	}
}

// --migrate retries while PostgreSQL says it is starting up, then migrates.
func TestMigrateWithRetryWaitsForStartup(t *testing.T) {
	t.Parallel()
	const refusals = 2
	dbURL, conns := startingUpServer(t, refusals)
	schema := testSchema(t)
	core, logs := observer.New(zapcore.DebugLevel)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	if err := migrateWithRetry(ctx, dbURL, schema, "", 100*time.Millisecond, zap.New(core)); err != nil {
		t.Fatalf("migrateWithRetry = %v, want nil", err)
	}
	if ctx.Err() != nil {
		t.Fatalf("migrateWithRetry gave up waiting: %v", ctx.Err())
	}
	if !tableExists(t, testConn(t), schema, "staged_jobs") {
		t.Fatalf("%s.staged_jobs does not exist after migrateWithRetry", schema)
	}
	retries := logs.FilterMessage("migrate failed, retrying").All()
	if len(retries) != refusals || conns.Load() != refusals+1 {
		t.Fatalf("%d retries logged over %d connections, want %d over %d", len(retries), conns.Load(), refusals, refusals+1)
	}
	if msg := fmt.Sprint(retries[0].ContextMap()["error"]); !strings.Contains(msg, "57P03") {
		t.Errorf("retry logged error %q, want the server's 57P03", msg)
	}
}

// startingUpServer listens on a loopback port, answers the first refusals
// connections as a PostgreSQL that is starting up (FATAL 57P03), and
// forwards the later ones to the test database. It returns a URL of the
// test database through it, and the count of connections so far.
func startingUpServer(t *testing.T, refusals int32) (string, *atomic.Int32) {
	t.Helper()
	cfg, err := pgx.ParseConfig(relaytest.DatabaseURL())
	if err != nil {
		t.Fatal(err)
	}
	upstream := net.JoinHostPort(cfg.Host, fmt.Sprint(cfg.Port))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		conns atomic.Int32
		wg    sync.WaitGroup
		mu    sync.Mutex
		open  []net.Conn
	)
	track := func(c net.Conn) {
		mu.Lock()
		defer mu.Unlock()
		open = append(open, c)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return // closed
			}
			track(c)
			n := conns.Add(1)
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				if n <= refusals {
					refuseStartingUp(c)
					return
				}
				up, err := net.Dial("tcp", upstream)
				if err != nil {
					return
				}
				track(up)
				defer up.Close()
				done := make(chan struct{})
				go func() { _, _ = io.Copy(up, c); up.Close(); close(done) }()
				_, _ = io.Copy(c, up)
				c.Close()
				<-done
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range open {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	u, err := url.Parse(relaytest.DatabaseURL())
	if err != nil || u.Host == "" {
		t.Fatalf("test database URL is not a URL with a host: %v", err)
	}
	u.Host = ln.Addr().String()
	// The refusals speak no TLS, and with sslmode prefer each attempt
	// would be two connections (TLS refused, then plain): count one.
	q := u.Query()
	q.Set("sslmode", "disable")
	u.RawQuery = q.Encode()
	return u.String(), &conns
}

// refuseStartingUp reads a client's startup message and answers it as
// PostgreSQL does while it starts up.
func refuseStartingUp(c net.Conn) {
	be := pgproto3.NewBackend(c, c)
	for {
		msg, err := be.ReceiveStartupMessage()
		if err != nil {
			return
		}
		if _, ok := msg.(*pgproto3.StartupMessage); ok {
			break
		}
		if _, err := c.Write([]byte("N")); err != nil { // no TLS, no GSS encryption
			return
		}
	}
	be.Send(&pgproto3.ErrorResponse{Severity: "FATAL", SeverityUnlocalized: "FATAL", Code: "57P03",
		Message: "the database system is starting up"})
	_ = be.Flush()
}
